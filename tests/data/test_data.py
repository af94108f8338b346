"""Tests of specjax.data on tiny inputs (a temp folder of .py files, small BPE vocabularies).

The real stdlib is never scanned here: `source_dir` points the `stdlib_code` builder at a folder
made by the `tiny_src` fixture, and each TFDS build of it takes about a second.
"""

import hashlib
import os
import platform

import numpy as np
import pytest

from specjax import data
from specjax.data import pipeline, stdlib_code
from specjax.interop.tokenizer import load_tokenizer

# (relative path, text). Names mod_67 / mod_154 hash into the held-out split, mod_0 / mod_1 do
# not (sha256 rule, checked independently in test_heldout_assignment_is_the_sha256_rule).
TINY_FILES = {
    'a.py': 'x = 1\n',
    'mod_0.py': '\tdef f():\n\t\treturn "é 日本 🚀"\n',
    'mod_1.py': 'if True:\r\n    pass\r\n',
    'mod_67.py': '  leading_spaces = 2\n\n\n',
    'mod_154.py': '',
    'pkg/__init__.py': '"""Package."""\n',
    'pkg/sub/deep.py': 'def deep():\n    return "<|endoftext|>"\n',
}
HELDOUT = {'mod_67.py', 'mod_154.py'}


def _write_tree(root, files):
  for rel, text in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode('utf-8'))


@pytest.fixture(scope='module')
def tiny_src(tmp_path_factory):
  root = tmp_path_factory.mktemp('src')
  _write_tree(root, TINY_FILES)
  (root / 'latin1.py').write_bytes('s = "caf\xe9"\n'.encode('latin-1'))  # not UTF-8: skipped
  (root / 'notes.txt').write_text('not python\n')
  _write_tree(root, {'site-packages/third_party.py': 'y = 2\n'})  # never the stdlib
  return root


@pytest.fixture(scope='module')
def tiny_data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('tfds')


def _examples(data_dir, source_dir):
  return {s: list(data.load_stdlib_code(s, data_dir=data_dir, source_dir=source_dir))
          for s in ('train', 'heldout')}


# --- stdlib_code builder ---------------------------------------------------------------------


def test_builder_reads_exact_texts_with_relative_paths(tiny_src, tiny_data_dir):
  examples = _examples(tiny_data_dir, tiny_src)
  got = {ex['path']: ex['text'] for split in examples.values() for ex in split}
  assert got == TINY_FILES  # no latin1.py, notes.txt or site-packages; '\r\n' kept as is
  assert all(isinstance(v, str) for s in examples.values() for ex in s for v in ex.values())
  assert {ex['path'] for ex in examples['heldout']} == HELDOUT


def test_split_sizes_sum_to_utf8_file_count(tiny_src, tiny_data_dir):
  sizes = data.split_sizes(data_dir=tiny_data_dir, source_dir=tiny_src)
  assert sizes == {'train': len(TINY_FILES) - len(HELDOUT), 'heldout': len(HELDOUT)}


def test_metadata_records_python_version_and_skips(tiny_src, tiny_data_dir):
  meta = data.stdlib_metadata(data_dir=tiny_data_dir, source_dir=tiny_src)
  assert meta['python_version'] == platform.python_version()
  assert meta['skipped_non_utf8'] == ['latin1.py']
  assert meta['source_dir'] == str(tiny_src)


def test_builder_is_deterministic(tiny_src, tiny_data_dir, tmp_path):
  first = _examples(tiny_data_dir, tiny_src)
  second = _examples(tmp_path / 'again', tiny_src)  # a fresh build, not the cached one
  assert first == second
  assert [ex['path'] for ex in first['train']] == sorted(ex['path'] for ex in first['train'])


def test_heldout_assignment_is_the_sha256_rule():
  for i in range(300):
    rel = f'pkg/mod_{i}.py'
    digest = hashlib.sha256(rel.encode()).digest()
    expected = 'heldout' if int.from_bytes(digest[:8], 'big') % 100 < 2 else 'train'
    assert data.split_of(rel) == expected
  assert {p for p in TINY_FILES if data.split_of(p) == 'heldout'} == HELDOUT


def test_adding_a_file_moves_no_other_file(tiny_src, tiny_data_dir, tmp_path):
  _write_tree(tmp_path / 'src', {**TINY_FILES, 'mod_168.py': 'z = 3\n'})  # mod_168 is held out
  bigger = _examples(tmp_path / 'tfds', tmp_path / 'src')
  before = _examples(tiny_data_dir, tiny_src)
  assert [ex['path'] for ex in bigger['train']] == [ex['path'] for ex in before['train']]
  assert {ex['path'] for ex in bigger['heldout']} == HELDOUT | {'mod_168.py'}


def test_real_stdlib_config_is_keyed_by_python_version():
  config = stdlib_code.stdlib_config()
  assert config.name == 'python_' + platform.python_version().replace('.', '_')
  assert 'site-packages' not in config.source_dir
  assert os.path.isfile(os.path.join(config.source_dir, 'os.py'))


def test_real_stdlib_builder_constructs_without_building(tmp_path):
  builder = stdlib_code.stdlib_builder(data_dir=tmp_path)
  assert builder.builder_config.name == stdlib_code.stdlib_config().name
  assert not builder.is_prepared()


def test_unknown_split_raises(tiny_src, tiny_data_dir):
  with pytest.raises(ValueError, match='unknown split'):
    data.load_stdlib_code('validation', data_dir=tiny_data_dir, source_dir=tiny_src)


# --- humaneval builder and data dirs ---------------------------------------------------------


def test_humaneval_has_164_problems_with_five_fields(tiny_data_dir):
  problems = data.load_humaneval(data_dir=tiny_data_dir)
  assert len(problems) == 164
  fields = {'task_id', 'prompt', 'canonical_solution', 'test', 'entry_point'}
  assert all(set(p) == fields for p in problems)
  assert [p['task_id'] for p in problems] == [f'HumanEval/{i}' for i in range(164)]
  assert problems[0]['entry_point'] == 'has_close_elements'
  assert problems[0]['prompt'].startswith('from typing import List')


def test_first_build_prints_one_line_and_no_tfds_chatter(tiny_src, tmp_path, capfd, caplog):
  """A first build says what it builds in one specjax line, without TFDS's "Downloading and
  preparing" (nothing is downloaded), its progress bars or its absl warnings about unbuilt
  version folders; a second load prints nothing, and TFDS's settings are restored."""
  import logging

  from tensorflow_datasets.core.utils import tqdm_utils
  level = logging.getLogger('absl').level
  with caplog.at_level(logging.WARNING):
    data.load_stdlib_code('train', data_dir=tmp_path, source_dir=tiny_src)
    data.load_humaneval(data_dir=tmp_path)
  out, err = capfd.readouterr()
  lines = [line for line in (out + err).splitlines() if line.strip()]
  assert lines == [f'building the stdlib_code dataset (first run only) in {tmp_path}',
                   f'building the humaneval dataset (first run only) in {tmp_path}'], lines
  assert not [r for r in caplog.records if r.name in ('absl', 'tensorflow_datasets')]
  assert tqdm_utils._active and logging.getLogger('absl').level == level
  data.load_humaneval(data_dir=tmp_path)
  assert capfd.readouterr() == ('', '')


_BUILD = """
import sys
from specjax import data
print(len(data.load_stdlib_code('train', data_dir=sys.argv[1], source_dir=sys.argv[2])))
"""


def test_concurrent_first_builds_wait_for_one_another(tiny_src, tiny_data_dir, tmp_path):
  """Two processes that find the dataset unbuilt at once (parallel test workers, two jobs of one
  user): one builds, the other waits on the data dir's lock and reads the same examples."""
  import subprocess
  import sys

  procs = [subprocess.Popen([sys.executable, '-c', _BUILD, str(tmp_path), str(tiny_src)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  results = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
  want = len(_examples(tiny_data_dir, tiny_src)['train'])
  assert [int(out.split()[-1]) for out, _ in results] == [want, want]
  assert sum('building the stdlib_code dataset' in err for _, err in results) == 1


def test_a_failing_build_still_raises(tmp_path, monkeypatch):
  """Silencing TFDS hides no error: one raised while generating examples reaches the caller."""
  from specjax.data import humaneval

  def broken(self, problems):
    raise RuntimeError('generator failed')
    yield

  monkeypatch.setattr(humaneval.Humaneval, '_generate_examples', broken)
  with pytest.raises(RuntimeError, match='generator failed'):
    data.load_humaneval(data_dir=tmp_path)


def test_unwritable_data_dir_raises_naming_it(tiny_src, tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  bad = str(blocker / 'data')  # cannot be created, even by root
  with pytest.raises(ValueError, match='a_file/data'):
    data.load_stdlib_code('train', data_dir=bad, source_dir=tiny_src)
  with pytest.raises(ValueError, match='a_file/data'):
    data.load_humaneval(data_dir=bad)


@pytest.mark.skipif(os.geteuid() == 0, reason='root can write to read-only directories')
def test_read_only_data_dir_raises_naming_it(tiny_src, tmp_path):
  ro = tmp_path / 'ro'
  ro.mkdir()
  ro.chmod(0o500)
  try:
    with pytest.raises(ValueError, match=str(ro)):
      data.load_stdlib_code('train', data_dir=ro, source_dir=tiny_src)
  finally:
    ro.chmod(0o700)


def test_default_data_dir_env_and_xdg(monkeypatch, tmp_path):
  monkeypatch.setenv('SPECJAX_DATA_DIR', str(tmp_path / 'mine'))
  assert data.default_data_dir() == str(tmp_path / 'mine')
  monkeypatch.delenv('SPECJAX_DATA_DIR')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert data.default_data_dir() == str(tmp_path / 'xdg' / 'specjax' / 'tensorflow_datasets')
  monkeypatch.delenv('XDG_CACHE_HOME')
  assert data.default_data_dir() == os.path.expanduser('~/.cache/specjax/tensorflow_datasets')


# --- tokenizer -------------------------------------------------------------------------------

TRAIN_TEXTS = [
    f'def function_{i}(x, y):\n    """Doc {i}."""\n    return x * {i} + y\n\n' for i in range(40)
] + ['class Point:\n\tdef __init__(self):\n\t\tself.x = 0\n'] * 10
WEIRD_TEXTS = [
    ' leading space', '   three', '\tTab\t\tmid\t', '\n\nnewlines first\n\n\n', '\r\n\r\n',
    'trailing   ', 'é ü ß 日本語 🚀 \u200b zero-width', 'a<|endoftext|>b', '', ' ', '\x00\x01\x7f',
]


@pytest.fixture(scope='module')
def small_tok():
  return data.train_tokenizer(TRAIN_TEXTS, vocab_size=300)


def test_tokenizer_round_trips_exactly(small_tok):
  for text in WEIRD_TEXTS + list(TINY_FILES.values()):
    ids = small_tok.encode(text).ids
    assert small_tok.decode(ids) == text, repr(text)
    assert data.eos_id(small_tok) not in ids  # literal '<|endoftext|>' text is not EOS


def test_tokenizer_vocab_size_and_eos(small_tok):
  assert small_tok.get_vocab_size() <= 300
  assert small_tok.get_vocab_size() > 257  # merges were learned, not just bytes + EOS
  assert data.eos_id(small_tok) == 0
  with pytest.raises(ValueError, match='vocab_size'):
    data.train_tokenizer(TRAIN_TEXTS, vocab_size=100)


def test_tokenizer_save_load(small_tok, tmp_path):
  path = data.save_tokenizer(small_tok, tmp_path / 'tok')
  assert path.endswith('tokenizer.json')
  loaded = data.for_corpus(load_tokenizer(tmp_path / 'tok'))
  assert loaded.encode_special_tokens  # the corpus setting tokenizer.json does not store
  for text in WEIRD_TEXTS:
    assert loaded.encode(text).ids == small_tok.encode(text).ids
  assert data.tokenizer_fingerprint(loaded) == data.tokenizer_fingerprint(small_tok)


def test_load_tokenizer_errors_name_the_file(small_tok, tmp_path):
  with pytest.raises(ValueError, match='no tokenizer file at .*missing'):
    load_tokenizer(tmp_path / 'missing')
  bad = tmp_path / 'bad.json'
  bad.write_text('{not json')
  with pytest.raises(ValueError, match='bad.json'):
    load_tokenizer(bad)
  path = data.save_tokenizer(small_tok, tmp_path / 'tok')
  with pytest.raises(ValueError, match=r'tokenizer\.json.* vocab_size is 257'):
    load_tokenizer(path, vocab_size=257)


def test_for_corpus_requires_eos():
  """A tokenizer without EOS cannot join documents; the pipeline refuses it."""
  tok = data.tokenizer.new_tokenizer()
  with pytest.raises(ValueError, match='endoftext'):
    data.for_corpus(tok)


def test_tokenize_corpus_matches_single_encodes(small_tok):
  got = data.tokenize_corpus(small_tok, WEIRD_TEXTS, chunk=3)
  assert got == [small_tok.encode(t).ids for t in WEIRD_TEXTS]


# --- packing and batches ---------------------------------------------------------------------

EOS_ID = 0


def test_pack_documents_keeps_every_token_in_order():
  docs = [[5, 6, 7], [8], [], [9, 10, 11, 12, 13]]
  packed = data.pack_documents(docs, seq_len=4, eos_id=EOS_ID)
  stream = [5, 6, 7, 0, 8, 0, 0, 9, 10, 11, 12, 13, 0]  # EOS after every document
  assert packed.dtype == np.int32 and packed.shape == (3, 5)  # ceil((13 - 1) / 4) rows of T+1
  # Rows overlap by one token: the stream is rows[:, :-1] read in order.
  np.testing.assert_array_equal(packed[:, :-1].reshape(-1), stream[:12])
  np.testing.assert_array_equal(packed[:-1, -1], packed[1:, 0])
  assert packed[-1, -1] == stream[-1]


def test_pack_wraps_to_a_document_start_instead_of_padding():
  packed = data.pack_documents([[1, 2, 3], [4, 5]], seq_len=4, eos_id=EOS_ID)
  # stream 1 2 3 0 4 5 0 (n=7): rows 1 2 3 0 4 | 4 5 0 1 2 — wraps after EOS to doc 0.
  np.testing.assert_array_equal(packed, [[1, 2, 3, 0, 4], [4, 5, 0, 1, 2]])
  with pytest.raises(ValueError, match='empty'):
    data.pack_documents([], seq_len=4, eos_id=EOS_ID)


def _packed(num_seqs=24, seq_len=8):
  return np.arange(num_seqs * (seq_len + 1), dtype=np.int32).reshape(num_seqs, seq_len + 1)


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_train_batches_shapes_and_shift():
  batch = next(data.make_train_iterator(_packed(), batch_size=4, seed=0))
  assert batch.inputs.shape == batch.targets.shape == (4, 8)
  assert batch.inputs.dtype == batch.targets.dtype == np.int32
  np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def test_train_batches_deterministic_per_seed_and_seeds_differ():
  a = _take(data.make_train_iterator(_packed(), 4, seed=1), 12)
  b = _take(data.make_train_iterator(_packed(), 4, seed=1), 12)
  c = _take(data.make_train_iterator(_packed(), 4, seed=2), 12)
  assert all(np.array_equal(x.inputs, y.inputs) for x, y in zip(a, b))
  assert not all(np.array_equal(x.inputs, y.inputs) for x, y in zip(a, c))


def test_each_epoch_is_a_new_permutation_of_all_rows():
  packed = _packed()
  def first_tokens(batches):
    return [int(r) for b in batches for r in b.inputs[:, 0]]
  batches = _take(data.make_train_iterator(packed, 4, seed=3), 12)  # two epochs of 6 steps
  epoch0, epoch1 = first_tokens(batches[:6]), first_tokens(batches[6:])
  assert sorted(epoch0) == sorted(epoch1) == sorted(packed[:, 0].tolist())
  assert epoch0 != epoch1
  assert epoch0 != sorted(epoch0)  # shuffled


def test_resume_at_step_k_equals_tail_of_uninterrupted_stream():
  full = _take(data.make_train_iterator(_packed(), 5, seed=7), 15)
  resumed = _take(data.make_train_iterator(_packed(), 5, seed=7, start_step=9), 6)
  for x, y in zip(full[9:], resumed):
    np.testing.assert_array_equal(x.inputs, y.inputs)
    np.testing.assert_array_equal(x.targets, y.targets)


def test_heldout_batches_are_fixed_and_in_order():
  packed = _packed(num_seqs=10)
  batches = data.heldout_batches(packed, batch_size=4)
  assert [b.inputs.shape[0] for b in batches] == [4, 4, 2]
  np.testing.assert_array_equal(np.concatenate([b.targets for b in batches]), packed[:, 1:])
  assert len(data.heldout_batches(packed, batch_size=4, drop_remainder=True)) == 2


def test_token_stream_cache_is_reused(small_tok, tmp_path, monkeypatch):
  texts = TRAIN_TEXTS[:5]
  stream = data.cached_token_stream(small_tok, texts, cache_dir=tmp_path)
  assert len(list(tmp_path.glob('tokens-*.npy'))) == 1
  monkeypatch.setattr(pipeline, 'tokenize_corpus', lambda *a, **k: pytest.fail('re-tokenized'))
  np.testing.assert_array_equal(data.cached_token_stream(small_tok, texts, cache_dir=tmp_path),
                                stream)
  expected = data.pack_documents([small_tok.encode(t).ids for t in texts], 16, EOS_ID)
  np.testing.assert_array_equal(data.pack_stream(stream, 16), expected)
