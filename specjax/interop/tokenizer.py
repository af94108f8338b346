"""Loading `tokenizer.json` (the HF `tokenizers` format) beside a checkpoint."""

from __future__ import annotations

import os

from tokenizers import Tokenizer


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer:
  """Reads a `tokenizer.json`; with `vocab_size`, refuses a tokenizer that emits ids >= it."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise ValueError(f"tokenizer file {path} does not exist")
  try:
    tok = Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise ValueError(f"cannot read tokenizer {path}: {e}") from e
  if vocab_size is not None and tok.get_vocab_size(with_added_tokens=True) > vocab_size:
    raise ValueError(f"tokenizer {path} has {tok.get_vocab_size(with_added_tokens=True)} tokens "
                     f"but the model's vocab_size is {vocab_size}")
  return tok
