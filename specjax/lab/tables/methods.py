"""The methods table: tau and speedup of every method per dataset at each sampling setting
(T = 0, T = 0.7 with top-p 0.9, T = 1 by default), batch 1 (the Spec-Bench / EAGLE-3 layout),
each row naming how it drafted and verified (children and rule, LOSSY for a lossy rule); speedup
is the mean and spread over `timing_repeats` passes."""

from __future__ import annotations

import os
from typing import Annotated

import numpy as np

from specjax import verify
from specjax.config_utils import Interval, NonEmpty, NonNegFloat, PosInt, config
from specjax.lab import report
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import AR, MethodRecord
from specjax.lab.session import Result, Session, Table, prompt_counts, public


@config
class MethodsTable:
  temperatures: Annotated[tuple[NonNegFloat, ...], NonEmpty] = (0.0, 0.7, 1.0)  # a row group each
  # The top-p of each temperature's rows, one per temperature, or one for all of them (the
  # job's top_k applies to all).
  top_p: Annotated[tuple[Annotated[float, Interval(gt=0, le=1)], ...], NonEmpty] = (1.0, 0.9, 1.0)
  timing_repeats: PosInt = 3  # passes over the prompts timed

  def __post_init__(self):
    if len(self.top_p) not in (1, len(self.temperatures)):
      raise ValueError(f"methods_table.top_p holds {len(self.top_p)} values for "
                       f"{len(self.temperatures)} temperature(s) {list(self.temperatures)}: "
                       "give one top-p per temperature, or one for all (--set "
                       "methods_table.top_p=1)")

  @property
  def settings(self) -> list[tuple[float, float]]:
    """(temperature, top-p) of each row group."""
    top_p = self.top_p * len(self.temperatures) if len(self.top_p) == 1 else self.top_p
    return [(float(t), float(p)) for t, p in zip(self.temperatures, top_p)]

  def check(self, cfg: BenchmarkConfig) -> None:
    """Nothing to check against the job's fields: every method runs at every temperature."""


def units(s: Session, t: MethodsTable) -> int:
  return (len(t.temperatures) * len(s.methods()) * t.timing_repeats
          * sum(len(s.prompts(d)) for d in s.datasets))


def build(s: Session, t: MethodsTable, out: str) -> Result:
  cfg, methods = s.cfg, s.methods()
  records = [r for temp, top_p in t.settings for d in s.datasets
             for r in s.measure(d, [(m, None) for m in methods],
                                sampling=s.sampling_at(temp, top_p), repeats=t.timing_repeats)]
  header = ["T", "top-p", "method", "drafting"] + [
      f"{d} {what}" for d in s.datasets for what in ("tau", "speedup")]
  header += ["mean tau", "mean speedup"]
  rows, differ = [], []
  for temp, top_p in t.settings:
    for m in methods:
      mine = [r for r in records if _at(r, temp, top_p) and r.method == m]
      cells = [f"{temp:g}", f"{top_p:g}", m, report.drafting(mine[0])]
      for r in mine:
        cells += [f"{r.tau:.2f}", report.speedup_cell(r.speedup_repeats)]
        if temp == 0 and not r.matches_autoregressive:
          differ.append(f"{m}/{r.dataset}")
      cells += [f"{np.mean([r.tau for r in mine]):.2f}",
                f"{np.mean([np.mean(r.speedup_repeats) for r in mine]):.2f}x"]
      rows.append(cells)
  ar = [f"{r.dataset} T={r.temperature:g}" + (f"/p={r.top_p:g}" if r.top_p < 1 else "")
        + f": {r.tokens_per_second:.0f}" for r in records if r.method == AR]
  lines = [f"### Methods ({prompt_counts(records)} x {cfg.max_new_tokens} new tokens per "
           f"dataset, batch 1)", ""] + report.table(header, rows) + [
      f"Speedup: over autoregressive decoding in the same run, mean ± spread (max - min) over "
      f"{t.timing_repeats} timed passes; tau is emitted tokens per target call (one pass: the "
      f"same seeds give the same tokens). Autoregressive tokens/s: {', '.join(ar)}.",
      f"Drafting: the children a drafter drew (top_k at T = 0 whatever it was built with) and "
      f"the rule that verified them (greedy matching at T = 0; at T > 0 {cfg.rule!r}"
      + (", which is LOSSY: its sampled rows are not the target's law" if
         verify.Rule(cfg.rule).lossy else ", lossless") + ").",
      "Greedy (T = 0) outputs equal autoregressive decoding's for every method"
      if not differ else f"WARNING: greedy outputs differ from autoregressive for {differ}", ""]
  figure = _plot(s, t, methods, records, os.path.join(out, "methods.png"))
  return Result("\n".join(lines), {"records": public(records), "differ": differ}, [figure])


def _at(r: MethodRecord, temperature: float, top_p: float) -> bool:
  return r.temperature == temperature and r.top_p == top_p


def _plot(s: Session, t: MethodsTable, methods, records, path: str) -> str:
  """Speedup per method, a bar per dataset with its spread, a panel per sampling setting."""
  plt = report.pyplot()
  fig, axes = plt.subplots(1, len(t.settings), figsize=(7 * len(t.settings), 4), squeeze=False)
  width = 0.8 / len(s.datasets)
  for ax, (temp, top_p) in zip(axes[0], t.settings):
    x = np.arange(len(methods))
    for i, d in enumerate(s.datasets):
      mine = [next(r for r in records if _at(r, temp, top_p) and r.dataset == d
                   and r.method == m) for m in methods]
      ax.bar(x + (i - (len(s.datasets) - 1) / 2) * width,
             [np.mean(r.speedup_repeats) for r in mine], width, label=d,
             yerr=[[np.mean(r.speedup_repeats) - min(r.speedup_repeats) for r in mine],
                   [max(r.speedup_repeats) - np.mean(r.speedup_repeats) for r in mine]])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, methods, rotation=30, ha="right")
    title = f"speedup vs autoregressive, T = {temp:g}" + (f", top-p {top_p:g}" if top_p < 1
                                                           else "")
    ax.set(title=title, ylabel="x")
    ax.legend()
  return report.save(fig, path)


TABLE = Table("methods", MethodsTable, build, units)
