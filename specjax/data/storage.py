"""Where the TFDS datasets live, and how a builder is prepared and read back.

Both builders (`stdlib_code`, `humaneval`) are built locally on first use into one data dir and
then read as random-access array_record sources; TensorFlow is never needed. TFDS hands text
features back as `bytes`, so `TextRecords` decodes them to `str` for the rest of specjax.
"""

from __future__ import annotations

import collections.abc
import contextlib
import fcntl
import logging
import os
import sys
import tempfile
from typing import Any

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core.utils import tqdm_utils

DATA_DIR_ENV = 'SPECJAX_DATA_DIR'
FILE_FORMAT = 'array_record'


def default_data_dir() -> str:
  """`$SPECJAX_DATA_DIR`, else `$XDG_CACHE_HOME/specjax/tensorflow_datasets` (~/.cache default).

  A specjax-owned directory rather than TFDS's `~/tensorflow_datasets`, so building the embedded
  corpus never mixes with (or is mistaken for) datasets a user downloaded with TFDS.
  """
  env = os.environ.get(DATA_DIR_ENV)
  if env:
    return os.path.abspath(os.path.expanduser(env))
  cache = os.environ.get('XDG_CACHE_HOME') or os.path.join('~', '.cache')
  return os.path.abspath(os.path.expanduser(os.path.join(cache, 'specjax', 'tensorflow_datasets')))


def resolve_data_dir(data_dir: str | os.PathLike | None) -> str:
  """An absolute data dir: the given one, or `default_data_dir()` when None."""
  if data_dir is None:
    return default_data_dir()
  return os.path.abspath(os.path.expanduser(os.fspath(data_dir)))


def ensure_writable(data_dir: str) -> None:
  """Creates `data_dir` and proves it writable, else raises ValueError naming it.

  Probing with a real file (not `os.access`) because root passes `os.access` on read-only mounts
  and TFDS would otherwise fail much later with an error that does not name the directory.
  """
  if os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise ValueError(f"specjax data dir {data_dir!r} is a file, not a folder")
  try:
    os.makedirs(data_dir, exist_ok=True)
    with tempfile.TemporaryFile(dir=data_dir):
      pass
  except OSError as e:
    raise ValueError(
        f'specjax data dir {data_dir!r} is not writable ({e.strerror or e}); '
        f'set {DATA_DIR_ENV} or pass data_dir= to a writable directory') from e


class LocalBuilder:
  """Mixin of the builders here (before `tfds.core.GeneratorBasedBuilder`): a builder's
  `code_path` is its module's file; TFDS's own lookup needs `importlib_resources` when `specjax`
  is a namespace."""

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(sys.modules[cls.__module__].__file__)


def text_info(builder: tfds.core.DatasetBuilder, fields: tuple[str, ...], *,
              homepage: str | None = None, **metadata: Any) -> tfds.core.DatasetInfo:
  """The info of a builder whose examples are the text `fields`, kept in the order written."""
  return tfds.core.DatasetInfo(
      builder=builder, description=builder.__doc__,
      features=tfds.features.FeaturesDict({f: tfds.features.Text() for f in fields}),
      metadata=tfds.core.MetadataDict(**metadata), homepage=homepage, disable_shuffling=True)


@contextlib.contextmanager
def quiet_tfds():
  """TFDS's chatter around a local build, silenced: its warnings (a custom config in use, a
  version folder not built yet) and its progress bars. Errors still raise, and ERROR records
  still print."""
  loggers = [logging.getLogger(name) for name in ('absl', 'tensorflow_datasets')]
  levels = [logger.level for logger in loggers]
  bars = getattr(tqdm_utils, '_active', True)
  for logger in loggers:
    logger.setLevel(logging.ERROR)
  tfds.disable_progress_bar()
  try:
    yield
  finally:
    tfds.display_progress_bar(bars)
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


def prepare(make_builder: collections.abc.Callable[[], tfds.core.DatasetBuilder]
            ) -> tfds.core.DatasetBuilder:
  """The dataset of `make_builder()`, built unless already prepared, saying so in one line
  instead of TFDS's "Downloading and preparing ... Subsequent calls will reuse this data" (nothing
  is downloaded); a prepared dir may be read-only.

  Builds are serialised across processes by a lock file in the data dir (parallel test workers,
  several jobs of one user): a process that waited builds nothing and makes its builder anew,
  since a builder reads the dataset's info when it is made."""
  with quiet_tfds():
    builder = make_builder()
    if builder.is_prepared():
      return builder
    root = os.fspath(builder.data_dir_root)
    ensure_writable(root)
    with _locked(os.path.join(root, f'.{builder.name}.lock')):
      builder = make_builder()
      if builder.is_prepared():
        return builder
      print(f'building the {builder.name} dataset (first run only) in {root}', file=sys.stderr,
            flush=True)
      # The two announcements are plain prints of the builder: only this instance's are dropped.
      builder._log_download_bytes = builder._log_download_done = lambda: None
      try:
        builder.download_and_prepare()
      finally:
        del builder._log_download_bytes, builder._log_download_done
  return builder


@contextlib.contextmanager
def _locked(path: str):
  """An exclusive advisory lock on `path` (created if absent), held for the block."""
  with open(path, 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def split_sizes_of(builder: tfds.core.DatasetBuilder, splits: tuple[str, ...]) -> dict[str, int]:
  """Examples per split; 0 for a split that had no examples (TFDS cannot write empty splits)."""
  recorded = builder.info.splits
  return {s: (recorded[s].num_examples if s in recorded else 0) for s in splits}


def records(builder: tfds.core.DatasetBuilder, split: str) -> TextRecords:
  """Random-access `str`-valued examples of one split (empty if the split had no examples)."""
  if split not in builder.info.splits:
    return TextRecords(())
  return TextRecords(builder.as_data_source(split))


def _to_python(value: Any) -> Any:
  if isinstance(value, bytes):
    return value.decode('utf-8')
  return value


class TextRecords(collections.abc.Sequence):
  """List-like view of a TFDS data source whose text features come back as `str`.

  Random access stays with the underlying array_record source (nothing is loaded up front), so
  `grain.MapDataset.source(records)` and `records[i]` both work on the full stdlib cheaply.
  """

  def __init__(self, source: collections.abc.Sequence):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    if index < 0:
      index += len(self)
    if not 0 <= index < len(self):
      raise IndexError(index)
    return {k: _to_python(v) for k, v in self._source[index].items()}

  def __iter__(self):
    for i in range(len(self)):
      yield self[i]

  def __repr__(self) -> str:
    return f'TextRecords(len={len(self)})'
