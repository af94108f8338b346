"""Byte-level BPE for the embedded default, trained with HF `tokenizers` on the stdlib train split.

Byte-level (GPT-2 style) so every string is encodable with no unknown token and
`decode(encode(text).ids) == text` exactly: no normalizer, no added prefix space, no offset
trimming. Code is whitespace-sensitive, so losing a leading space or a tab would change programs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from specjax import files
from specjax.interop.tokenizer import tokenizer_path

EOS = '<|endoftext|>'


def _configure(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
  """Runtime settings that `tokenizer.json` does not store.

  `encode_special_tokens`: the literal text '<|endoftext|>' inside a source file is encoded as
  ordinary bytes, so EOS appears only where the pipeline puts it and such text still round-trips.
  """
  tok.encode_special_tokens = True
  return tok


def new_tokenizer() -> tokenizers.Tokenizer:
  """An untrained byte-level BPE with the exact-round-trip settings."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return _configure(tok)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> tokenizers.Tokenizer:
  """Trains byte-level BPE on `texts`; `<|endoftext|>` gets id 0 and doubles as EOS.

  All 256 byte symbols are seeded into the vocabulary (`initial_alphabet`), so text with bytes
  never seen in training still encodes. The vocabulary has at most `vocab_size` entries (fewer if
  the corpus runs out of merges that occur `min_frequency` times).
  """
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise ValueError(f'vocab_size={vocab_size} < {len(alphabet) + 1} (256 bytes + EOS)')
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=min_frequency,
      special_tokens=[EOS],
      initial_alphabet=alphabet,
      show_progress=show_progress)
  tok = new_tokenizer()
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def eos_id(tok: tokenizers.Tokenizer) -> int:
  """Id of `<|endoftext|>`, the end-of-document token."""
  token_id = tok.token_to_id(EOS)
  if token_id is None:
    raise ValueError(f'tokenizer has no {EOS!r} token')
  return token_id


def for_corpus(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
  """`tok`, checked and set up for the training corpus (load it with
  `specjax.interop.tokenizer.load_tokenizer`): it must have EOS, the token the pipeline joins
  documents with, and gets the runtime settings `tokenizer.json` does not store."""
  if tok.token_to_id(EOS) is None:
    raise ValueError(f'tokenizer has no {EOS!r} token; it was not made by train_tokenizer')
  return _configure(tok)


def save_tokenizer(tok: tokenizers.Tokenizer, path: str | os.PathLike) -> str:
  """Writes `tokenizer.json` into directory `path` (or to `path` itself if it ends in .json),
  atomically (a temp file then a rename: a failed write keeps the previous file)."""
  out = tokenizer_path(path)
  files.save_tokenizer(tok, out)
  return out
