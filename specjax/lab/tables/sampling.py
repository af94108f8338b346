"""The sampling table: per learned drafter at T = 1 (by default), tau and speedup with each way
of drafting children (deterministic top-k, i.i.d. draws from q, draws without replacement) under
each acceptance rule, on the job's first dataset: what sampled drafting buys, and which rule
pays most.

A pair a rule cannot verify is left out, with the reason (`verify.RuleMismatch`): k-sequential
selection needs i.i.d. children in a tree whose counts are fixed before the draws. Typical
acceptance is lossy, and its columns say so.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import numpy as np

from specjax import verify
from specjax.children import MODES
from specjax.config_utils import Interval, NonEmpty, NonEmptyStr, PosInt, config
from specjax.drafters import registry
from specjax.lab import report
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import AR, MethodRecord
from specjax.lab.session import (
  Result,
  Session,
  Table,
  check_methods,
  prompt_counts,
  public,
)


@config
class SamplingTable:
  methods: tuple[NonEmptyStr, ...] = ()  # () = every learned drafter of the run
  temperature: Annotated[float, Interval(gt=0)] = 1.0
  top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
  children: Annotated[tuple[Literal["top_k", "iid", "wor"], ...], NonEmpty] = MODES  # a row each
  rules: Annotated[tuple[Literal["recursive", "kseq", "typical"], ...], NonEmpty] = verify.RULES
  timing_repeats: PosInt = 3  # passes over the prompts timed

  def check(self, cfg: BenchmarkConfig) -> None:
    check_methods("sampling_table.methods", self.methods, registry.families(), cfg)


def units(s: Session, t: SamplingTable) -> int:
  return (len(s.learned(t.methods)) * len(t.rules) * (1 + len(t.children)) * t.timing_repeats
          * len(s.prompts(s.first_dataset)))


def build(s: Session, t: SamplingTable, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  methods = s.learned(t.methods)
  if not methods:
    raise ValueError("no learned drafter in this run: name one with --set drafter.<family>=DIR "
                     "or --set sampling_table.methods=...")
  sampling = s.sampling_at(t.temperature, t.top_p)
  records: list[MethodRecord] = []
  skipped: list[dict[str, str]] = []
  for method in methods:
    for rule in t.rules:
      modes = []
      for mode in t.children:
        try:  # what the rule refuses whatever the tree (k-sequential selection of top-k, say)
          verify.check_children(verify.Rule(rule), mode)
          modes.append(mode)
        except verify.RuleMismatch as e:
          skipped.append({"method": method, "children": mode, "rule": rule, "reason": str(e)})
      runs = [(AR, {})] + [(method, {**cfg.options_for(method), "children": m}) for m in modes]
      try:
        records += s.measure(dataset, runs, sampling=sampling, repeats=t.timing_repeats,
                             rule=rule)[1:] if modes else []
      except verify.RuleMismatch as e:  # this drafter's trees (EAGLE-2's pruned one, say)
        skipped += [{"method": method, "children": m, "rule": rule, "reason": str(e)}
                    for m in modes]
  header = ["drafter", "children"] + [f"{rule}{' (LOSSY)' if verify.Rule(rule).lossy else ''} "
                                      f"{what}" for rule in t.rules for what in ("tau", "speedup")]
  rows = []
  for method in methods:
    for mode in t.children:
      cells = [method, mode]
      for rule in t.rules:
        r = _record(records, method, mode, rule)
        cells += ["-", "-"] if r is None else [f"{r.tau:.2f}",
                                               report.speedup_cell(r.speedup_repeats)]
      rows.append(cells)
  top_p = f", top-p {t.top_p:g}" if t.top_p < 1 else ""
  lines = [f"### Sampled drafting (T = {t.temperature:g}{top_p}, {dataset}, "
           f"{prompt_counts(records) if records else 'no runs'} x {cfg.max_new_tokens} new "
           "tokens, batch 1)", ""] + report.table(header, rows) + [
      "children: top_k drafts the drafter's k most likely tokens (q one-hot), iid draws each "
      "child from q independently, wor draws without replacement (Gumbel-top-k); q is the "
      "drafter's distribution at the run's temperature. Rules: recursive rejection and "
      "k-sequential selection are lossless (the output is the target's law); typical "
      "acceptance is LOSSY. Speedup: over autoregressive decoding in the same run, mean ± "
      f"spread over {t.timing_repeats} timed passes.", ""]
  reasons = sorted({(sk["rule"], sk["reason"]) for sk in skipped})
  if reasons:
    lines += ["`-`: a rule that cannot verify these children:"] + [
        f"- {rule}: {reason}" for rule, reason in reasons] + [""]
  figure = _plot(methods, t, records, os.path.join(out, "sampling.png"))
  return Result("\n".join(lines), {"records": public(records), "skipped": skipped}, [figure])


def _record(records: list[MethodRecord], method: str, mode: str, rule: str
            ) -> MethodRecord | None:
  """The run of `method` built with children `mode`, verified by `rule` (None: skipped)."""
  return next((r for r in records if r.method == method and r.rule == rule
               and r.options.get("children") == mode), None)


def _plot(methods: list[str], t: SamplingTable, records: list[MethodRecord], path: str) -> str:
  """Speedup per drafter, a bar per (children, rule) with its spread."""
  plt = report.pyplot()
  pairs = [(mode, rule) for rule in t.rules for mode in t.children]
  fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(methods) * len(pairs) / 3), 4))
  width = 0.8 / len(pairs)
  x = np.arange(len(methods))
  for i, (mode, rule) in enumerate(pairs):
    found = [_record(records, m, mode, rule) for m in methods]
    means = [np.nan if r is None else np.mean(r.speedup_repeats) for r in found]
    errors: list[Any] = [[0 if r is None else np.mean(r.speedup_repeats) - min(r.speedup_repeats)
                          for r in found],
                         [0 if r is None else max(r.speedup_repeats) - np.mean(r.speedup_repeats)
                          for r in found]]
    label = f"{mode}, {rule}" + (" (LOSSY)" if verify.Rule(rule).lossy else "")
    ax.bar(x + (i - (len(pairs) - 1) / 2) * width, means, width, yerr=errors, label=label)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(x, methods, rotation=30, ha="right")
  ax.set(title=f"speedup vs autoregressive, T = {t.temperature:g}", ylabel="x")
  ax.legend(fontsize="small")
  return report.save(fig, path)


TABLE = Table("sampling", SamplingTable, build, units)
