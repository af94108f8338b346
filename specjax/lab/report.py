"""The writers every measurement of the lab shares: Markdown tables and their cells, figures
saved atomically, so that the main job's results and every reproduce table print a figure, its
spread and its unreliable mark the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from specjax import files, metrics


def pyplot():
  """matplotlib's pyplot on the Agg backend: figures are files, never windows."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def spread(values: Sequence[float]) -> float:
  """max - min: the benchmark's ± for timings."""
  return float(max(values) - min(values)) if values else 0.0


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
