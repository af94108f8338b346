"""Prompts cut from Python source where a function's docstring ends: the shape of a HumanEval
prompt (signature, docstring, then the body is the model's to write).

Self-distillation from random corpus offsets mostly asks the target to continue mid-statement;
code benchmarks ask it to write a function body after a docstring. `docstring_prompts` cuts the
second kind from any Python source (the stdlib train split for the shipped drafters), so a drafter
can be trained on the situation it is evaluated in without seeing benchmark problems.
"""

from __future__ import annotations

import ast
from typing import Callable, Sequence

import numpy as np


def docstring_ends(text: str) -> list[int]:
  """Character offsets just past the line that closes each function docstring in `text`.

  A function (sync or async, at any nesting) counts when its first statement is a string literal.
  The offset is past that line's newline, so a prompt ends the way HumanEval's do (`\"\"\"\\n`).
  Source that does not parse, or whose docstring line has code after it, gives nothing.
  """
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):  # ValueError: null bytes in the source
    return []
  line_starts = np.concatenate([[0], np.flatnonzero(np.frombuffer(
      text.encode("utf-8"), np.uint8) == ord("\n")) + 1])
  encoded = text.encode("utf-8")
  ends = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
      continue
    doc = node.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)):
      continue
    # ast offsets are UTF-8 byte columns; end_lineno is 1-based.
    stop = int(line_starts[doc.end_lineno - 1]) + doc.end_col_offset
    newline = encoded.find(b"\n", stop)
    if newline < 0 or encoded[stop:newline].strip() not in (b"", b";"):
      continue
    ends.append(len(encoded[:newline + 1].decode("utf-8")))
  return sorted(ends)


def docstring_prompts(texts: Sequence[str], encode: Callable[[str], Sequence[int]], *,
                      num_tokens: int, rows: int, seed: int,
                      context_chars: int = 4096) -> np.ndarray:
  """int32[rows, num_tokens]: the last `num_tokens` tokens of source up to a docstring's end.

  Cut points are drawn uniformly (with `seed`) from every function docstring in `texts` that has
  at least `num_tokens` tokens of source before its end; every cut is used once before any is
  used twice. Each prompt tokenizes at most the `context_chars` characters before its cut,
  which is plenty for `num_tokens` tokens of code and keeps the cost linear in the corpus.
  Raises ValueError when `texts` has no usable docstring.
  """
  cuts = [(i, end) for i, text in enumerate(texts) for end in docstring_ends(text)]
  rng = np.random.default_rng(seed)
  out: list[np.ndarray] = []
  while len(out) < rows:  # passes over the cuts in fresh random orders, skipping short ones
    found = len(out)
    for j in rng.permutation(len(cuts)):
      i, end = cuts[j]
      ids = encode(texts[i][max(0, end - context_chars):end])
      if len(ids) >= num_tokens:
        out.append(np.asarray(ids[-num_tokens:], np.int32))
        if len(out) == rows:
          break
    if len(out) == found:
      raise ValueError(f"no function docstring in the given source has {num_tokens} tokens of "
                       "source before its end: cannot cut docstring prompts")
  return np.stack(out)
