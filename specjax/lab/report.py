"""The writers of the lab's Markdown and figures: tables and their cells (a figure with its
spread and its unreliable mark), figures saved atomically, the provenance line, and the main
job's results.md and plots built on them. The benchmark and every reproduce table write through
these, so the same figure reads the same everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from specjax import files, metrics
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import MAX_RELATIVE_SPREAD, PHASES, MethodRecord
from specjax.rounds import PREFILL_CHUNK


def pyplot():
  """matplotlib's pyplot on the Agg backend: figures are files, never windows."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def spread(values: Sequence[float]) -> float:
  """max - min: the benchmark's ± for timings."""
  return float(max(values) - min(values)) if values else 0.0


def measured_with(provenance_line: str) -> str:
  """The line that opens every results file: what measured it (`provenance.header`)."""
  return f"Measured with {provenance_line}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  """A Markdown table's lines and the blank line that ends it."""
  return [*metrics.markdown_table(header, rows), ""]


def speedup_cell(repeats: Sequence[float]) -> str:
  """A speedup as the mean ± spread of its timed passes."""
  return f"{np.mean(repeats):.2f}x ±{spread(repeats):.2f}"


def mark(unreliable: bool | Sequence[str]) -> str:
  """` ?` after a figure that is unreliable or rests on one (a non-empty list of them)."""
  return " ?" if unreliable else ""


def ms(value: float, unreliable: bool) -> str:
  """A phase's ms per round, `?` when `unreliable_timings` says it cannot be trusted."""
  return f"{value:.2f}" + mark(unreliable)


def save(fig, path: str, group: files.FileGroup | None = None) -> str:
  """`fig` laid out and written atomically (a failed write keeps the previous PNG), or staged
  in `group` (`files.atomic_group`) to be replaced with its files; the figure is closed."""
  fig.tight_layout()
  try:
    (files if group is None else group).save_figure(fig, path, dpi=120)
  finally:
    pyplot().close(fig)
  return path


def cell(value: float | None, spec: str, unreliable: bool, spread: float | None = None,
          unit: str = "") -> str:
  """A table cell: the value (`n/a` when undefined), its spread, and `?` when unreliable."""
  text = "n/a" if value is None else format(value, spec) + unit
  if spread is not None:
    text += f" ±{format(spread, spec)}"
  return text + (" ?" if unreliable else "")


def drafting(record: MethodRecord) -> str:
  """How a run drafted and verified, as its table's "drafting" column says: children and rule
  ("iid, recursive"; at T = 0 "top_k, greedy"), LOSSY after a lossy rule, "-" without a drafter."""
  if record.children is None:
    return "-"
  return f"{record.children}, {record.rule}" + (" LOSSY" if record.lossy else "")


def format_bytes(n: int) -> str:
  """`n` bytes in KiB below a MiB, MiB below a GiB, else GiB (two decimals)."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n / 2**10:.2f} KiB"


def layout_lines(mesh_layout: dict[str, Any]) -> list[str]:
  """The mesh line and a table of parameter bytes per device (see `layout`)."""
  rows = [[name] + [format_bytes(b[k]) for k in ("min", "max", "total", "one_copy")]
          for name, b in mesh_layout["param_bytes"].items()]
  return [f"Mesh: {mesh_layout['mesh']}", "", *metrics.markdown_table(
      ["parameters", "min per device", "max per device", "total over devices", "one copy"],
      rows), ""]


FOOTNOTE = (f"± is the spread (max - min) of a timing across trials; `?` marks a figure that is "
            f"not positive, whose spread exceeds {MAX_RELATIVE_SPREAD:.0%} of it, that rests on "
            f"such a timing, or a loop efficiency above 100%. The phase timings (draft, verify, "
            f"prefill ms) depend on a method's shapes, not on its prompts: each is measured once "
            f"per method and padded prompt length, on the first prompt of the first dataset "
            f"that needs it. The prefill runs in chunks of {PREFILL_CHUNK} positions up to the "
            f"prompt's length: the bound with prefill scales the timed one by each prompt's "
            f"chunks.")


def markdown(records: Sequence[MethodRecord], cfg: BenchmarkConfig,
             provenance_line: str | None = None, mesh_layout: dict[str, Any] | None = None
             ) -> str:
  """The results table per dataset. Timings show their spread across trials (±); a `?` marks a
  figure that is unreliable (`unreliable_figures`) or rests on one that is. With `mesh_layout`
  (a run on a mesh: `layout`) the mesh and the parameter bytes per device come first."""
  lines = [measured_with(provenance_line), ""] if provenance_line else []
  lines += layout_lines(mesh_layout) if mesh_layout else []
  for dataset in dict.fromkeys(r.dataset for r in records):
    lines += dataset_table([r for r in records if r.dataset == dataset], cfg) + [""]
  return "\n".join(lines + ([FOOTNOTE, ""] if cfg.profile else []))


def prompts_ran(record: MethodRecord, cfg: BenchmarkConfig) -> tuple[str, str]:
  """The prompts a record's run decoded, as its table's header says: how many (of how many the
  config asked for, when the dataset had fewer), and a note of the empty ones skipped and of
  how many were cut ('' when none)."""
  info = record.prompt_set
  if info is None:  # records of a caller that chose its own prompts
    return f"{record.prompts} prompts", ""
  count = f"{info['prompts']} prompts"
  if info["prompts"] < cfg.num_prompts:
    count += f" (of {cfg.num_prompts} asked: the dataset has {info['available']})"
  notes = []
  if info["empty_skipped"]:
    notes.append(f"{info['empty_skipped']} empty prompt(s) skipped")
  if info["truncated"]:
    notes.append(f"{info['truncated']} cut to their last {cfg.max_prompt_tokens} tokens")
  return count, ", ".join(notes)


def dataset_table(records: Sequence[MethodRecord], cfg: BenchmarkConfig) -> list[str]:
  """The Markdown lines of one dataset's table (its records, finished by `finish`; without
  `cfg.profile`, by `add_speedups`: no phase columns)."""
  count, notes = prompts_ran(records[0], cfg)
  lines = [f"### {records[0].dataset} (T={cfg.temperature}, {count} x {cfg.max_new_tokens} "
           f"new tokens, batch 1{'; ' + notes if notes else ''})", ""]
  header = ["method", "drafting", "tau", "tokens/s", "speedup", "target calls"]

  def measured(r: MethodRecord) -> list[Any]:
    return [r.method, drafting(r), f"{r.tau:.2f}", f"{r.tokens_per_second:.1f}",
            f"{r.speedup:.2f}x", r.target_calls]

  if not cfg.profile:
    return lines + metrics.markdown_table(header, [measured(r) for r in records])
  lines += metrics.markdown_table(
      header + ["draft ms/round", "verify ms/round", "prefill ms", "drafting share",
                "ideal (decode)", "ideal (with prefill)", "loop efficiency", "unreliable"])
  for r in records:
    p, f = r.phases, r.figures
    bad = set(f.unreliable_figures)
    own = {name: name in bad for name in PHASES}
    ar_bad = {name: f"autoregressive {name}" in bad for name in PHASES}
    decode = own["t_draft"] or own["t_verify"] or ar_bad["t_verify"]  # tau x t_AR / round
    e2e = decode or own["t_prefill"] or ar_bad["t_prefill"]
    lines.append(metrics.markdown_row(measured(r) + [
        cell(p.t_draft_ms, ".2f", own["t_draft"], p.t_draft_spread_ms),
        cell(p.t_verify_ms, ".2f", own["t_verify"], p.t_verify_spread_ms),
        cell(p.t_prefill_ms, ".1f", own["t_prefill"], p.t_prefill_spread_ms),
        cell(f.draft_share, ".0%", decode),
        cell(f.ideal_speedup, ".2f", decode, unit="x"),
        cell(f.ideal_speedup_e2e, ".2f", e2e, unit="x"),
        cell(f.loop_efficiency, ".0%", e2e or "loop_efficiency" in bad),
        ", ".join(f.unreliable_figures) or "-"]))
  return lines


def plot_acceptance(records: Sequence[MethodRecord], path: str,
                    group: files.FileGroup | None = None) -> str:
  """Acceptance rate by draft depth, one panel per dataset and one line per method; saved
  atomically, or staged in `group` (`files.atomic_group`) to be replaced with its files."""
  plt = pyplot()
  datasets = list(dict.fromkeys(r.dataset for r in records))
  fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
  for ax, dataset in zip(axes[0], datasets):
    for r in records:
      alpha = r.acceptance_by_depth
      if r.dataset == dataset and alpha:
        ax.plot(range(1, len(alpha) + 1), [np.nan if a is None else a for a in alpha],
                marker="o", label=r.method)
    ax.set(title=f"acceptance rate by depth: {dataset}", xlabel="draft depth d",
           ylabel="P(accept d | accepted d-1)", ylim=(0, 1.05))
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
    else:  # autoregressive decoding alone drafts nothing
      ax.text(0.5, 0.5, "no drafter in this run", ha="center", transform=ax.transAxes)
  return save(fig, path, group)


def plot(records: Sequence[MethodRecord], out: str, group: files.FileGroup | None = None
         ) -> list[str]:
  """acceptance_by_depth.png and speedup.png in `out` (atomically, or staged in `group`)."""
  plt = pyplot()
  paths = [plot_acceptance(records, os.path.join(out, "acceptance_by_depth.png"), group)]
  datasets = list(dict.fromkeys(r.dataset for r in records))
  fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
  for ax, dataset in zip(axes[0], datasets):
    rows = [r for r in records if r.dataset == dataset]
    x = np.arange(len(rows))
    profiled = rows[0].figures is not None  # phase timings were measured
    width = 0.4 if profiled else 0.8
    ax.bar(x - 0.2 if profiled else x, [r.speedup for r in rows], width, label="measured")
    if profiled:
      ax.bar(x + 0.2, [np.nan if r.figures.ideal_speedup is None else r.figures.ideal_speedup
                        for r in rows], width, label="ideal (tau x t_AR / t_round)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, [r.method for r in rows], rotation=30, ha="right")
    ax.set(title=f"speedup vs autoregressive: {dataset}", ylabel="x")
    ax.legend()
  return paths + [save(fig, os.path.join(out, "speedup.png"), group)]
