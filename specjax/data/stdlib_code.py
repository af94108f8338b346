"""TFDS builder `stdlib_code`: the running interpreter's standard library as a code corpus.

The embedded default LM is trained on this corpus (README, "The embedded default"): it is on
every machine, needs no network, and is real, idiomatic Python. The held-out split is chosen by a
stable hash of each file's relative path, so a file never moves between splits when other files
are added or removed, and the assignment is the same on every machine and Python build.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from collections.abc import Iterator

import tensorflow_datasets as tfds

from specjax.data import storage

SPLITS = ('train', 'heldout')
HELDOUT_PERCENT = 2
# Third-party code is not the stdlib; pyenv and Debian place it inside the stdlib folder.
_EXCLUDED_DIRS = frozenset({'site-packages', 'dist-packages', '__pycache__'})


def stdlib_dir() -> str:
  """The running interpreter's pure-Python standard library folder."""
  return os.path.abspath(sysconfig.get_paths()['stdlib'])


def split_of(relpath: str) -> str:
  """'heldout' iff the first 8 bytes of sha256(relpath) mod 100 < HELDOUT_PERCENT.

  sha256 rather than `hash()`: Python salts `hash()` per process, which would reshuffle the
  splits on every run.
  """
  digest = hashlib.sha256(relpath.encode('utf-8')).digest()
  return 'heldout' if int.from_bytes(digest[:8], 'big') % 100 < HELDOUT_PERCENT else 'train'


def python_files(source_dir: str) -> list[str]:
  """Sorted posix relative paths of the `.py` files under `source_dir`.

  Sorted because `os.walk` order depends on the file system, and the dataset must come out the
  same on every build. Directory symlinks are not followed, so no file is read twice.
  """
  found = []
  for root, dirs, files in os.walk(source_dir):
    dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
    for name in files:
      path = os.path.join(root, name)
      if name.endswith('.py') and os.path.isfile(path):
        found.append(os.path.relpath(path, source_dir).replace(os.sep, '/'))
  return sorted(found)


def read_utf8(path: str) -> str | None:
  """The file's exact text (no newline translation), or None if it is not valid UTF-8."""
  with open(path, 'rb') as f:
    raw = f.read()
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError:
    return None


def _folder_fingerprint(source_dir: str) -> str:
  """Cheap content key of a folder: relative paths, sizes and mtimes (no file is read)."""
  h = hashlib.sha256()
  for rel in python_files(source_dir):
    st = os.stat(os.path.join(source_dir, rel))
    h.update(f'{rel}\0{st.st_size}\0{st.st_mtime_ns}\n'.encode())
  return h.hexdigest()


@dataclasses.dataclass(eq=False)
class StdlibCodeConfig(tfds.core.BuilderConfig):
  """Which folder of `.py` files to read; the name keys the on-disk copy."""
  source_dir: str = ''


def stdlib_config() -> StdlibCodeConfig:
  """The running interpreter's stdlib, one copy per Python version (`python_3_11_7`)."""
  version = platform.python_version()
  return StdlibCodeConfig(
      name='python_' + version.replace('.', '_').replace('+', ''),
      description=f'.py files of the Python {version} standard library',
      source_dir=stdlib_dir())


def folder_config(source_dir: str | os.PathLike) -> StdlibCodeConfig:
  """Any folder of `.py` files (tests, CI): keyed by path and file stats, so edits rebuild."""
  source_dir = os.path.abspath(os.fspath(source_dir))
  if not os.path.isdir(source_dir):
    raise ValueError(f'source_dir {source_dir!r} is not a directory')
  key = hashlib.sha256(source_dir.encode() + _folder_fingerprint(source_dir).encode())
  return StdlibCodeConfig(
      name='folder_' + key.hexdigest()[:12],
      description=f'.py files under {source_dir}',
      source_dir=source_dir)


class StdlibCode(storage.LocalBuilder, tfds.core.GeneratorBasedBuilder):
  """Every UTF-8 `.py` file of the running interpreter's standard library.

  Features: `path` (posix path relative to the stdlib folder) and `text` (exact file contents).
  Files that are not valid UTF-8 (CPython ships a few on purpose, as encoding tests) are skipped
  and listed in `info.metadata['skipped_non_utf8']`; `site-packages` / `dist-packages` are never
  read. `info.metadata['python_version']` records the interpreter whose stdlib was read.
  Examples are stored in sorted path order (shuffling is the training pipeline's job), so two
  builds of the same folder are identical.
  """

  name = 'stdlib_code'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Stdlib .py files, train/heldout split by sha256 of the path.'}
  BUILDER_CONFIGS = [stdlib_config()]

  def _info(self) -> tfds.core.DatasetInfo:
    return storage.text_info(
        self, ('path', 'text'), python_version=platform.python_version(),
        source_dir=self.builder_config.source_dir, heldout_percent=HELDOUT_PERCENT,
        skipped_non_utf8=[])

  def _split_generators(self, dl_manager):
    """Reads every file up front (the stdlib is ~35 MB) so the skip list is final before writing."""
    del dl_manager  # Nothing is downloaded.
    source_dir = self.builder_config.source_dir
    by_split = {s: [] for s in SPLITS}
    skipped = []
    for rel in python_files(source_dir):
      text = read_utf8(os.path.join(source_dir, rel))
      if text is None:
        skipped.append(rel)
      else:
        by_split[split_of(rel)].append((rel, text))
    self.info.metadata['skipped_non_utf8'] = skipped
    # TFDS cannot write an empty split; loaders report a missing split as empty.
    return {s: self._generate_examples(ex) for s, ex in by_split.items() if ex}

  def _generate_examples(self, examples) -> Iterator[tuple[str, dict[str, str]]]:
    for rel, text in examples:
      yield rel, {'path': rel, 'text': text}


def stdlib_builder(data_dir=None, source_dir=None) -> StdlibCode:
  """The (unprepared) builder for the stdlib, or for `source_dir` when given."""
  # The stdlib config is registered in BUILDER_CONFIGS, and TFDS wants it named, not re-made.
  config = StdlibCode.BUILDER_CONFIGS[0].name if source_dir is None else folder_config(source_dir)
  with storage.quiet_tfds():  # a folder's config is "custom": TFDS warns of it at every load
    return StdlibCode(config=config, data_dir=storage.resolve_data_dir(data_dir),
                      file_format=storage.FILE_FORMAT)


def load_stdlib_code(split: str, data_dir=None, source_dir=None) -> storage.TextRecords:
  """Examples `{'path': str, 'text': str}` of `split` ('train' | 'heldout'), built on first use.

  `source_dir` replaces the stdlib with any folder of `.py` files (tests and CI use a tiny one).
  Raises ValueError if the dataset must be built and `data_dir` is not writable.
  """
  if split not in SPLITS:
    raise ValueError(f'unknown split {split!r}; expected one of {SPLITS}')
  builder = storage.prepare(lambda: stdlib_builder(data_dir, source_dir))
  return storage.records(builder, split)


def split_sizes(data_dir=None, source_dir=None) -> dict[str, int]:
  """`{'train': n, 'heldout': m}` for the stdlib (or `source_dir`) dataset, built on first use."""
  builder = storage.prepare(lambda: stdlib_builder(data_dir, source_dir))
  return storage.split_sizes_of(builder, SPLITS)


def stdlib_metadata(data_dir=None, source_dir=None) -> dict:
  """What the build recorded: python_version, source_dir, heldout_percent, skipped_non_utf8."""
  builder = storage.prepare(lambda: stdlib_builder(data_dir, source_dir))
  return dict(builder.info.metadata)
