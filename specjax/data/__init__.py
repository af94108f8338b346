"""Data for the embedded default: TFDS corpora, the byte-level BPE tokenizer, training batches.

Typical use (shape letters: B batch, T tokens):

  from specjax import data
  train = [ex['text'] for ex in data.load_stdlib_code('train')]   # built on first use
  tok = data.train_tokenizer(train, vocab_size=8192)
  stream = data.cached_token_stream(tok, train)                    # int32[n], cached .npy
  packed = data.pack_stream(stream, seq_len=T)                     # int32[num_seqs, T+1]
  for batch in data.make_train_iterator(packed, B, seed=0, start_step=step):
    ...  # batch['inputs'], batch['targets']: int32[B, T]

A saved tokenizer is reused as `data.for_corpus(load_tokenizer(path))`
(`specjax.interop.tokenizer.load_tokenizer`, the one loader; `for_corpus` adds the corpus
settings that tokenizer.json does not store).

Datasets live in `default_data_dir()` ($SPECJAX_DATA_DIR, else ~/.cache/specjax/...).
"""

from specjax.data.humaneval import load_humaneval
from specjax.data.pipeline import cached_token_stream
from specjax.data.pipeline import corpus_fingerprint
from specjax.data.pipeline import heldout_batches
from specjax.data.pipeline import join_documents
from specjax.data.pipeline import make_train_iterator
from specjax.data.pipeline import pack_documents
from specjax.data.pipeline import pack_stream
from specjax.data.pipeline import tokenize_corpus
from specjax.data.pipeline import TrainBatches
from specjax.data.stdlib_code import load_stdlib_code
from specjax.data.stdlib_code import split_of
from specjax.data.stdlib_code import split_sizes
from specjax.data.stdlib_code import stdlib_dir
from specjax.data.stdlib_code import stdlib_metadata
from specjax.data.storage import default_data_dir
from specjax.data.tokenizer import EOS
from specjax.data.tokenizer import eos_id
from specjax.data.tokenizer import for_corpus
from specjax.data.tokenizer import save_tokenizer
from specjax.data.tokenizer import train_tokenizer
from specjax.interop.tokenizer import tokenizer_fingerprint
