"""The methods table: tau and speedup of every method per dataset at each temperature, batch 1
(the Spec-Bench / EAGLE-3 layout); speedup is the mean and spread over `timing_repeats`
passes."""

from __future__ import annotations

import os
from typing import Annotated

import numpy as np

from specjax.config_utils import NonEmpty, NonNegFloat, PosInt, config
from specjax.lab import report
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import AR
from specjax.lab.session import Result, Session, Table, prompt_counts, public


@config
class MethodsTable:
  temperatures: Annotated[tuple[NonNegFloat, ...], NonEmpty] = (0.0, 1.0)  # a row group each
  timing_repeats: PosInt = 3  # passes over the prompts timed

  def check(self, cfg: BenchmarkConfig) -> None:
    """Nothing to check against the job's fields: every method runs at every temperature."""


def units(s: Session, t: MethodsTable) -> int:
  return (len(t.temperatures) * len(s.methods()) * t.timing_repeats
          * sum(len(s.prompts(d)) for d in s.datasets))


def build(s: Session, t: MethodsTable, out: str) -> Result:
  cfg, methods = s.cfg, s.methods()
  records = [r for temp in t.temperatures for d in s.datasets
             for r in s.measure(d, [(m, None) for m in methods], sampling=s.sampling_at(temp),
                                repeats=t.timing_repeats)]
  header = ["T", "method"] + [f"{d} {what}" for d in s.datasets for what in ("tau", "speedup")]
  header += ["mean tau", "mean speedup"]
  rows, differ = [], []
  for temp in t.temperatures:
    for m in methods:
      mine = [r for r in records if r.temperature == float(temp) and r.method == m]
      cells = [f"{float(temp):g}", m]
      for r in mine:
        cells += [f"{r.tau:.2f}", report.speedup_cell(r.speedup_repeats)]
        if float(temp) == 0 and not r.matches_autoregressive:
          differ.append(f"{m}/{r.dataset}")
      cells += [f"{np.mean([r.tau for r in mine]):.2f}",
                f"{np.mean([np.mean(r.speedup_repeats) for r in mine]):.2f}x"]
      rows.append(cells)
  ar = [f"{r.dataset} T={r.temperature:g}: {r.tokens_per_second:.0f}"
        for r in records if r.method == AR]
  lines = [f"### Methods ({prompt_counts(records)} x {cfg.max_new_tokens} new tokens per "
           f"dataset, batch 1)", ""] + report.table(header, rows) + [
      f"Speedup: over autoregressive decoding in the same run, mean ± spread (max - min) over "
      f"{t.timing_repeats} timed passes; tau is emitted tokens per target call (one pass: the "
      f"same seeds give the same tokens). Autoregressive tokens/s: {', '.join(ar)}.",
      "Greedy (T = 0) outputs equal autoregressive decoding's for every method"
      if not differ else f"WARNING: greedy outputs differ from autoregressive for {differ}", ""]
  figure = _plot(s, t, methods, records, os.path.join(out, "methods.png"))
  return Result("\n".join(lines), {"records": public(records), "differ": differ}, [figure])


def _plot(s: Session, t: MethodsTable, methods, records, path: str) -> str:
  """Speedup per method, a bar per dataset with its spread, a panel per temperature."""
  plt = report.pyplot()
  fig, axes = plt.subplots(1, len(t.temperatures), figsize=(7 * len(t.temperatures), 4),
                           squeeze=False)
  width = 0.8 / len(s.datasets)
  for ax, temp in zip(axes[0], t.temperatures):
    x = np.arange(len(methods))
    for i, d in enumerate(s.datasets):
      mine = [next(r for r in records if r.temperature == float(temp) and r.dataset == d
                   and r.method == m) for m in methods]
      ax.bar(x + (i - (len(s.datasets) - 1) / 2) * width,
             [np.mean(r.speedup_repeats) for r in mine], width, label=d,
             yerr=[[np.mean(r.speedup_repeats) - min(r.speedup_repeats) for r in mine],
                   [max(r.speedup_repeats) - np.mean(r.speedup_repeats) for r in mine]])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, methods, rotation=30, ha="right")
    ax.set(title=f"speedup vs autoregressive, T = {float(temp):g}", ylabel="x")
    ax.legend()
  return report.save(fig, path)


TABLE = Table("methods", MethodsTable, build, units)
