"""Seconds per iteration of compiled loops whose trip count is a traced argument.

A call of such a loop costs a fixed part (dispatch, moving the carry in and out, whatever runs
before the loop) plus n iterations. Timing a call of n iterations against a call of none cancels
the fixed part: (t(n) - t(0)) / n. The zero-iteration call runs the same compiled program, so its
fixed cost is the long call's, and it costs almost nothing to repeat: against a baseline of
n / 2 iterations (the other common choice), the same long run times in two thirds of the time,
and the baseline adds no iterations' noise of its own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from specjax import checks


def wall(call: Callable[[], Any]) -> float:
  """Seconds of `call()` (which waits for what it runs)."""
  start = time.perf_counter()
  call()
  return time.perf_counter() - start


def per_unit(long: np.ndarray, base: np.ndarray, units: int) -> tuple[float, np.ndarray]:
  """Seconds per unit of the work that `long` calls run beyond `base` calls (per-trial wall
  times, one of each per trial), `units` units of it: the fastest long call less the fastest
  base call, over `units`, and the per-trial estimates (long - base) / units, whose range is the
  figure's spread. Nothing is clamped (see `per_iteration`)."""
  long, base = np.asarray(long), np.asarray(base)
  return float(long.min() - base.min()) / units, (long - base) / units


def per_iteration(runs: Mapping[str, Callable[[int], Any]], n: int, trials: int
                  ) -> dict[str, tuple[float, np.ndarray]]:
  """For each named `run` (`run(k)` runs k iterations of one compiled loop and waits for them):
  seconds per iteration, the fastest of `trials` runs of `n` iterations minus the fastest of
  `trials` runs of none, over n, and the per-trial estimates (their range is the figure's
  spread). A one-iteration call of each comes first: it compiles the loop and runs its body once,
  since the body's first execution is slow (on 2 CPU cores, after a call of none the first run
  of 20 decode rounds took up to 1.9x as long as the next ones; after a call of one, 1.1x). Then
  the trials interleave every loop, so a drift in the machine's speed hits them all alike.
  Nothing is clamped: a difference of noisy timings can come out negative, and a caller judging
  the figure needs to see that."""
  n = checks.integer("timed iterations", n, lo=1)
  trials = checks.integer("trials", trials, lo=1)
  for run in runs.values():
    run(1)
  zero = {name: [] for name in runs}
  long = {name: [] for name in runs}
  for _ in range(trials):
    for name, run in runs.items():
      zero[name].append(wall(functools.partial(run, 0)))
      long[name].append(wall(functools.partial(run, n)))
  return {name: per_unit(long[name], zero[name], n) for name in runs}
