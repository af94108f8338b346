"""`specjax.timing`: per-iteration seconds of a compiled loop against a call of none, on a fake
clock (no timing of this machine, so nothing here depends on its speed)."""

import numpy as np
import pytest

from specjax import timing


class Clock:
  """`time.perf_counter` that moves only when a fake loop runs: each call costs `fixed` plus
  `per` a iteration, and the first call of a loop `compile` more; every call is logged."""

  def __init__(self):
    self.now = 0.0
    self.calls = []

  def __call__(self) -> float:
    return self.now

  def loop(self, name: str, fixed: float, per: float, compile: float = 0.0, jitter=()):
    jitter = iter(jitter)

    def run(n: int):
      first = not any(c[0] == name for c in self.calls)
      self.calls.append((name, n))
      self.now += fixed + n * per + (compile if first else 0.0) + next(jitter, 0.0)
    return run


@pytest.fixture
def clock(monkeypatch):
  c = Clock()
  monkeypatch.setattr(timing.time, "perf_counter", c)
  return c


def test_the_fixed_cost_and_the_compile_cancel(clock):
  runs = {"verify": clock.loop("verify", fixed=0.5, per=0.002, compile=3.0),
          "round": clock.loop("round", fixed=0.25, per=0.005, compile=2.0)}
  out = timing.per_iteration(runs, 40, trials=3)
  assert out["verify"][0] == pytest.approx(0.002)
  assert out["round"][0] == pytest.approx(0.005)
  np.testing.assert_allclose(out["round"][1], [0.005] * 3)
  # One one-iteration call each compiles and warms up; then each trial times none and n of
  # every loop.
  assert clock.calls[:2] == [("verify", 1), ("round", 1)]
  assert clock.calls[2:] == [("verify", 0), ("verify", 40), ("round", 0), ("round", 40)] * 3


def test_fastest_runs_and_the_spread_of_the_trials(clock):
  # Per call: the compile, then (zero, long) per trial; the second trial's long run is slow.
  run = clock.loop("x", fixed=1.0, per=0.01, jitter=[0.0, 0.0, 0.0, 0.0, 0.2])
  seconds, per_trial = timing.per_iteration({"x": run}, 10, trials=2)["x"]
  assert seconds == pytest.approx(0.01)  # the fastest long run less the fastest zero run
  np.testing.assert_allclose(per_trial, [0.01, 0.03])


def test_a_noisy_difference_is_not_clamped(clock):
  # The long run came out faster than a zero run: the estimate says so instead of hiding it.
  run = clock.loop("x", fixed=1.0, per=0.0, jitter=[0.0, 0.5, 0.0])
  seconds, _ = timing.per_iteration({"x": run}, 5, trials=1)["x"]
  assert seconds == pytest.approx(-0.1)


def test_bad_counts(clock):
  run = clock.loop("x", fixed=0.0, per=0.0)
  with pytest.raises(ValueError, match="timed iterations"):
    timing.per_iteration({"x": run}, 0, trials=1)
  with pytest.raises(ValueError, match="trials"):
    timing.per_iteration({"x": run}, 1, trials=0)
