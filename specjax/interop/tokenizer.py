"""Reading `tokenizer.json` (the HF `tokenizers` format) and fingerprinting a tokenizer.

The one loader and the one fingerprint: checkpoints, drafters and the training pipeline all read
tokenizers here, so a missing or corrupt file is reported the same way everywhere.
"""

from __future__ import annotations

import hashlib
import os

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_path(path: str | os.PathLike) -> str:
  """A folder means `<folder>/tokenizer.json` (the HF layout); a `.json` path is used as is."""
  path = os.fspath(path)
  return path if path.endswith(".json") else os.path.join(path, TOKENIZER_FILE)


def load_tokenizer(path: str | os.PathLike, *, vocab_size: int | None = None) -> Tokenizer:
  """Reads a `tokenizer.json` (or a folder holding one), with errors that name the file.

  With `vocab_size`, refuses a tokenizer that can emit ids >= it: the model could not embed them.
  """
  src = tokenizer_path(path)
  if not os.path.isfile(src):
    raise FileNotFoundError(f"no tokenizer file at {src!r}")
  try:
    tok = Tokenizer.from_file(src)
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise ValueError(f"{src!r} is not a valid tokenizer.json: {e}") from e
  n = tok.get_vocab_size(with_added_tokens=True)
  if vocab_size is not None and n > vocab_size:
    raise ValueError(f"tokenizer {src!r} has {n} tokens but the model's vocab_size is "
                     f"{vocab_size}")
  return tok


def tokenizer_fingerprint(tok: Tokenizer | None) -> str | None:
  """sha256 of the serialized tokenizer (None for None): equal fingerprints mean equal token
  ids, so it pairs drafters with targets and keys caches of tokenized text."""
  return None if tok is None else hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
