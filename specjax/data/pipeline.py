"""Training batches for LM training: tokenize, join documents with EOS, pack, shuffle, batch.

Packing (shape letters: B batch, T tokens): the corpus becomes one token stream
`doc_0 EOS doc_1 EOS ... doc_n EOS`, cut into rows of T+1 tokens that overlap by one token
(row i = stream[i*T : i*T + T + 1]). Every adjacent pair of the stream is then exactly one
(input, target) pair, and `inputs = row[:-1]`, `targets = row[1:]`. The last row wraps around to
the start of the stream, which is a real document boundary (EOS -> first document), so no padding
token and no loss mask are needed.

Batches are a pure function of (seed, step), built with grain's random-access `MapDataset`:
restarting at step k yields exactly batches k, k+1, ... of the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence

import grain
import numpy as np
import tokenizers
from flax import struct

from specjax import files
from specjax.data import storage
from specjax.data import tokenizer as tokenizer_lib
from specjax.interop.tokenizer import tokenizer_fingerprint


@struct.dataclass
class LMBatch:
  """One step's rows of causal-LM training (or evaluation): a pytree, so the training loop moves
  and shards it whole (each field split over the mesh's `data` axis on its batch dimension),
  and a typed one, so a loss reads `batch.targets` rather than a key it might misspell."""

  inputs: np.ndarray  # int32[B, T]
  targets: np.ndarray  # int32[B, T]: the token after each input (the rows shifted by one)


def tokenize_corpus(
    tok: tokenizers.Tokenizer, texts: Iterable[str], chunk: int = 256,
) -> list[list[int]]:
  """Token ids of each text (no special tokens added); `encode_batch` runs on all cores."""
  out: list[list[int]] = []
  buf: list[str] = []
  for text in texts:
    buf.append(text)
    if len(buf) == chunk:
      out.extend(e.ids for e in tok.encode_batch(buf, add_special_tokens=False))
      buf = []
  if buf:
    out.extend(e.ids for e in tok.encode_batch(buf, add_special_tokens=False))
  return out


def join_documents(token_lists: Iterable[Sequence[int]], eos_id: int) -> np.ndarray:
  """int32[n]: each document followed by EOS, so the model learns where documents end."""
  parts = []
  eos = np.array([eos_id], np.int32)
  for ids in token_lists:
    parts.append(np.asarray(ids, np.int32))
    parts.append(eos)
  if not parts:
    raise ValueError('cannot pack an empty corpus')
  return np.concatenate(parts)


def pack_stream(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """int32[num_seqs, seq_len + 1] rows of `stream` with stride `seq_len` (see module docstring).

  num_seqs = ceil((n - 1) / seq_len), at least 1; indices past the end wrap to the start.
  """
  if seq_len < 1:
    raise ValueError(f'seq_len must be >= 1, got {seq_len}')
  stream = np.asarray(stream, np.int32)
  n = stream.shape[0]
  num_seqs = max(1, -(-(n - 1) // seq_len))
  flat = stream[np.arange(num_seqs * seq_len + 1) % n]
  rows = np.lib.stride_tricks.sliding_window_view(flat, seq_len + 1)[::seq_len]
  return np.ascontiguousarray(rows, dtype=np.int32)


def pack_documents(
    token_lists: Iterable[Sequence[int]], seq_len: int, eos_id: int,
) -> np.ndarray:
  """int32[num_seqs, seq_len + 1]: documents joined with EOS and packed (module docstring)."""
  return pack_stream(join_documents(token_lists, eos_id), seq_len)


def corpus_fingerprint(texts: Iterable[str]) -> str:
  """sha256 over the texts, length-prefixed so ['ab', 'c'] and ['a', 'bc'] differ."""
  h = hashlib.sha256()
  for text in texts:
    raw = text.encode('utf-8')
    h.update(len(raw).to_bytes(8, 'little'))
    h.update(raw)
  return h.hexdigest()


def default_cache_dir() -> str:
  """Token caches live beside the TFDS datasets they were made from."""
  return os.path.join(storage.default_data_dir(), 'specjax_token_cache')


def cached_token_stream(
    tok: tokenizers.Tokenizer, texts: Sequence[str], cache_dir: str | None = None,
) -> np.ndarray:
  """`join_documents(tokenize_corpus(tok, texts), eos)`, cached as .npy.

  Keyed by tokenizer and corpus fingerprints, so a retrained tokenizer or a different Python's
  stdlib never reads a stale cache. The stream (not the packed rows) is cached so any `seq_len`
  reuses it; packing is a cheap numpy view. Written to a temp file then renamed, so a killed run
  never leaves a truncated cache behind.
  """
  texts = list(texts)
  key = hashlib.sha256(
      (tokenizer_fingerprint(tok) + corpus_fingerprint(texts)).encode()
  ).hexdigest()[:24]
  cache_dir = storage.resolve_data_dir(cache_dir or default_cache_dir())
  path = os.path.join(cache_dir, f'tokens-{key}.npy')
  if os.path.isfile(path):
    return np.load(path)
  stream = join_documents(tokenize_corpus(tok, texts), tokenizer_lib.eos_id(tok))
  storage.ensure_writable(cache_dir)
  files.save_npy(path, stream)
  return stream


class TrainBatches:
  """Infinite stream of shuffled batches; `batches[step]` is a pure function of (seed, step).

  grain's `shuffle` before `repeat` draws a new permutation of the rows each epoch (seeded by
  seed and epoch), and `batch` after `repeat` lets batches run across epoch boundaries, so every
  step has a full batch of B rows whatever the number of rows.
  """

  def __init__(self, tokens_packed: np.ndarray, batch_size: int, seed: int):
    packed = np.asarray(tokens_packed, np.int32)
    if packed.ndim != 2 or packed.shape[0] == 0 or packed.shape[1] < 2:
      raise ValueError(f'expected packed int32[num_seqs, T+1], got shape {packed.shape}')
    if batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {batch_size}')
    self.packed = packed
    self.batch_size = batch_size
    self.seed = seed
    self._rows = (
        grain.MapDataset.range(packed.shape[0])
        .shuffle(seed=seed)
        .repeat()
        .batch(batch_size))

  @property
  def steps_per_epoch(self) -> float:
    """Rows / B; fractional because batches run across epoch boundaries."""
    return self.packed.shape[0] / self.batch_size

  def __getitem__(self, step: int) -> LMBatch:
    rows = self.packed[self._rows[step]]  # [B, T+1]
    return LMBatch(inputs=rows[:, :-1], targets=rows[:, 1:])

  def iterate(self, start_step: int = 0) -> Iterator[LMBatch]:
    """Batches start_step, start_step + 1, ... forever."""
    step = start_step
    while True:
      yield self[step]
      step += 1

  def __iter__(self) -> Iterator[LMBatch]:
    return self.iterate(0)


def make_train_iterator(
    tokens_packed: np.ndarray, batch_size: int, seed: int, start_step: int = 0,
) -> Iterator[LMBatch]:
  """Infinite `LMBatch`es of int32[B, T] rows, resuming at `start_step`."""
  return TrainBatches(tokens_packed, batch_size, seed).iterate(start_step)


def heldout_batches(
    tokens_packed: np.ndarray, batch_size: int, drop_remainder: bool = False,
) -> list[LMBatch]:
  """All rows once, in order, for evaluation; the last batch is smaller unless dropped."""
  packed = np.asarray(tokens_packed, np.int32)
  out = []
  for start in range(0, packed.shape[0], batch_size):
    rows = packed[start:start + batch_size]
    if drop_remainder and rows.shape[0] < batch_size:
      break
    out.append(LMBatch(inputs=rows[:, :-1], targets=rows[:, 1:]))
  return out
