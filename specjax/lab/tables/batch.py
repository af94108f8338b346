"""The batch table: tokens/s, tau and speedup at several batch sizes (each row of a batch
accepts its own number of draft tokens per round)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Annotated, Any

from specjax import drafters
from specjax.config_utils import NonEmpty, NonEmptyStr, PosInt, config
from specjax.lab import report
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import AR, TableRow
from specjax.lab.session import Result, Session, Table, check_methods, public


@config
class BatchTable:
  methods: tuple[NonEmptyStr, ...] = ("prompt_lookup", "draft_lm", "eagle")
  sizes: Annotated[tuple[PosInt, ...], NonEmpty] = (1, 4, 16)  # rows per batch
  num_prompts: PosInt = 16  # the prompts the batches are made of

  def __post_init__(self):
    if max(self.sizes) > self.num_prompts:
      raise ValueError(f"sizes holds {max(self.sizes)}, more than the num_prompts "
                       f"({self.num_prompts}) a batch is made of")

  def check(self, cfg: BenchmarkConfig) -> None:
    check_methods("batch_table.methods", self.methods, [AR, *drafters.names()], cfg)


@dataclasses.dataclass
class BatchRow(TableRow):
  """A run at one batch size, and whether its outputs are batch-1 autoregressive decoding's."""

  matches_batch1_autoregressive: bool


def units(s: Session, t: BatchTable) -> int:
  n = len(s.prompts(s.first_dataset, t.num_prompts))
  reference = 0 if 1 in t.sizes else n  # batch-1 AR, measured for the comparison
  return sum(math.ceil(n / b) for b in t.sizes) * (len(t.methods) + 1) + reference


def build(s: Session, t: BatchTable, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  methods = [AR] + [m for m in t.methods if m != AR]
  records = [r for b in t.sizes for r in s.measure(
      dataset, [(m, None) for m in methods], batch_size=b, num_prompts=t.num_prompts)]
  # Batch-1 autoregressive decoding is the reference every output is compared with, measured
  # for it when the table's sizes leave batch 1 out.
  ar1 = [r for r in records if r.method == AR and r.batch_size == 1] or s.measure(
      dataset, [(AR, None)], batch_size=1, num_prompts=t.num_prompts)
  reference = ar1[0].outputs
  checked = [BatchRow(r, r.outputs == reference) for r in records]
  rows = []
  for m in methods:
    cells: list[Any] = [m]
    for b in t.sizes:
      r = next(r for r in records if r.method == m and r.batch_size == b)
      cells += [f"{r.tokens_per_second:.0f}", f"{r.tau:.2f}", f"{r.speedup:.2f}x"]
    rows.append(cells)
  differ = [f"{c.record.method}@{c.record.batch_size}" for c in checked
            if not c.matches_batch1_autoregressive]
  n = len(s.prompts(dataset, t.num_prompts))
  header = ["method"] + [f"batch {b} {what}" for b in t.sizes
                         for what in ("tokens/s", "tau", "speedup")]
  lines = [f"### Batch size on {dataset} (T = 0, {n} prompts x {cfg.max_new_tokens} new "
           "tokens)", ""] + report.table(header, rows) + [
      "tokens/s: every row's new tokens over the wall time; each row of a batch accepts its "
      "own number of draft tokens per round (ragged acceptance), and the batch's round waits for "
      "none of them. Speedup: over autoregressive decoding at the same batch size.",
      "Every output equals batch-1 autoregressive decoding's" if not differ
      else f"Outputs that differ from batch-1 autoregressive decoding: {differ}", ""]
  figure = _plot(t, methods, records, os.path.join(out, "batch.png"))
  return Result("\n".join(lines), {"records": public(checked), "differ": differ}, [figure])


def _plot(t: BatchTable, methods, records, path: str) -> str:
  """tokens/s and tau against the batch size, a line per method."""
  plt = report.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for m in methods:
    mine = [next(r for r in records if r.method == m and r.batch_size == b)
            for b in t.sizes]
    axes[0].plot(t.sizes, [r.tokens_per_second for r in mine], "o-", label=m)
    axes[1].plot(t.sizes, [r.tau for r in mine], "o-", label=m)
  for ax, what in zip(axes, ("tokens/s", "tau")):
    ax.set(title=what, xlabel="batch size", xscale="log")
    ax.legend()
  return report.save(fig, path)


TABLE = Table("batch", BatchTable, build, units)
