"""The field's speculative-decoding metrics, computed one way everywhere.

tau: emitted tokens per target forward pass (autoregressive decoding: 1.0 exactly).
alpha_d: P(the depth-d draft node is accepted | its parent was), from `hist`, where hist[k]
counts the rounds that accepted exactly k draft nodes (k = 0..N).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def tau(new_tokens: int, target_calls: int) -> float:
  """Emitted tokens / target forward passes (prefill included)."""
  return new_tokens / target_calls


def acceptance_by_depth(hist: Sequence[int], unreached=None) -> list:
  """alpha_d for d = 1..N from the accepted-count histogram.

  A depth no round reached with an accepted parent has no rate: it is `unreached` (None keeps
  results JSON valid; pass float('nan') for arithmetic).
  """
  hist = np.asarray(hist, np.int64)
  reached = hist[::-1].cumsum()[::-1]  # reached[d] = rounds that accepted >= d nodes
  return [float(reached[d] / reached[d - 1]) if reached[d - 1] else unreached
          for d in range(1, len(hist))]


def markdown_row(cells: Sequence[Any]) -> str:
  """One Markdown table row: `| a | b |` (cells through `str`)."""
  return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]] = ()) -> list[str]:
  """A Markdown table's lines: the header, its separator and one line per row. With no rows it
  is the head of a table whose rows are printed as they come (`markdown_row`)."""
  return [markdown_row(header), "|" + "---|" * len(header), *map(markdown_row, rows)]
