"""Data for the embedded default: TFDS corpora, the byte-level BPE tokenizer, training batches.

Typical use (shape letters: B batch, T tokens):

  from specjax import data
  train = [ex['text'] for ex in data.load_stdlib_code('train')]   # built on first use
  tok = data.train_tokenizer(train, vocab_size=8192)
  stream = data.cached_token_stream(tok, train)                    # int32[n], cached .npy
  packed = data.pack_stream(stream, seq_len=T)                     # int32[num_seqs, T+1]
  for batch in data.make_train_iterator(packed, B, seed=0, start_step=step):
    ...  # batch.inputs, batch.targets: int32[B, T] (an `LMBatch`)

A saved tokenizer is reused as `data.for_corpus(load_tokenizer(path))`
(`specjax.interop.tokenizer.load_tokenizer`, the one loader; `for_corpus` adds the corpus
settings that tokenizer.json does not store).

Datasets live in `default_data_dir()` ($SPECJAX_DATA_DIR, else ~/.cache/specjax/...).
"""

from specjax.data.docstrings import load_stdlib_docstrings
from specjax.data.humaneval import load_humaneval
from specjax.data.pipeline import (
    LMBatch,
    TrainBatches,
    cached_token_stream,
    corpus_fingerprint,
    heldout_batches,
    join_documents,
    make_train_iterator,
    pack_documents,
    pack_stream,
    tokenize_corpus,
)
from specjax.data.stdlib_code import (
    load_stdlib_code,
    split_of,
    split_sizes,
    stdlib_dir,
    stdlib_metadata,
)
from specjax.data.storage import default_data_dir
from specjax.data.tokenizer import EOS, eos_id, for_corpus, save_tokenizer, train_tokenizer
from specjax.interop.tokenizer import tokenizer_fingerprint

__all__ = [
    "cached_token_stream",
    "corpus_fingerprint",
    "default_data_dir",
    "EOS",
    "eos_id",
    "for_corpus",
    "heldout_batches",
    "join_documents",
    "LMBatch",
    "load_humaneval",
    "load_stdlib_code",
    "load_stdlib_docstrings",
    "make_train_iterator",
    "pack_documents",
    "pack_stream",
    "save_tokenizer",
    "split_of",
    "split_sizes",
    "stdlib_dir",
    "stdlib_metadata",
    "tokenize_corpus",
    "tokenizer_fingerprint",
    "train_tokenizer",
    "TrainBatches",
]
