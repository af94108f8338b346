"""Atomic writes: every file specjax writes (results, tables, plots, exports, caches) goes to a
temporary file in the target's own folder and is renamed over the target (`os.replace`) only once
it is complete and flushed to disk, so an interrupted or failed write (a full disk, an exception
midway, a killed process) leaves the previous file byte for byte as it was, never a truncated
one, and no temporary file behind (a killed process can leave one: a hidden `.<name>.*.tmp*`
beside its target, never read by anything).

  atomic_path(path)             a temporary path to hand to a writer that takes a file name
  atomic_write(path, "w")       a file object, as `open` gives
  write_json, write_text, save_npy, save_figure, save_safetensors, save_tokenizer
  atomic_group()                several files replaced together once all are written (a results
                                folder's results.json, results.md and plots: all new or all old)
  atomic_dir(path)              a whole folder (a drafter or an HF export): written as a sibling
                                folder, then swapped in

A replaced file keeps the previous file's permission bits; a new one gets those `open` would
give it (0666 less the umask), not the owner-only ones of a temporary file. A target that is a
symbolic link is written through it: the file it points at is replaced, the link is kept.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_TMP = ".tmp"


def _umask() -> int:
  try:
    with open("/proc/self/status") as f:  # Linux: read without changing it
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def _mode_for(final: str, default: int) -> int:
  """The permission bits a replacement of `final` gets: the existing one's, else `default`
  less the umask."""
  try:
    return stat.S_IMODE(os.stat(final).st_mode)
  except OSError:
    return default & ~_umask()


def _fsync_file(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _fsync_dir(path: str) -> None:
  """Makes a rename in folder `path` durable; best effort (not every system can open a folder)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _target(path: str | os.PathLike) -> str:
  """The file a write of `path` replaces: absolute, through symbolic links."""
  return os.path.realpath(os.fspath(path))


def _remove(path: str) -> None:
  with contextlib.suppress(FileNotFoundError):
    os.remove(path)


def _new_temp(final: str, suffix: str | None = None) -> str:
  """A new empty file beside `final` under a unique hidden name ending in `suffix` (default:
  `final`'s extension, so writers that pick a format from the name pick the same one)."""
  folder, name = os.path.split(final)
  os.makedirs(folder, exist_ok=True)
  ext = os.path.splitext(name)[1] if suffix is None else suffix
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=_TMP + ext)
  os.close(fd)
  os.chmod(tmp, _mode_for(final, 0o666))
  return tmp


def _seal(tmp: str, final: str) -> None:
  """A written temporary file made ready to replace `final`: the permission bits `final` has
  (or a new file would get; a writer that replaces the file itself, as safetensors' does,
  leaves owner-only ones), and its bytes on disk."""
  os.chmod(tmp, _mode_for(final, 0o666))
  _fsync_file(tmp)


class _Staged:
  """Temporary files waiting to replace their targets (`commit`) or to be removed (`discard`)."""

  def __init__(self):
    self._pending: list[tuple[str, str]] = []

  def stage(self, path: str | os.PathLike, write: Callable[[str], Any],
            suffix: str | None = None) -> str:
    """Runs `write(tmp)` on a new temporary file beside `path` and fsyncs it; on a failure the
    temporary file is removed and the error raised."""
    final = _target(path)
    tmp = _new_temp(final, suffix)
    try:
      write(tmp)
      _seal(tmp, final)
    except BaseException:
      _remove(tmp)
      raise
    self._pending.append((tmp, final))
    return final

  def commit(self) -> None:
    pending, self._pending = self._pending, []
    try:
      while pending:
        tmp, final = pending[0]
        os.replace(tmp, final)
        pending.pop(0)
        _fsync_dir(os.path.dirname(final))
    finally:
      for tmp, _ in pending:
        _remove(tmp)

  def discard(self) -> None:
    pending, self._pending = self._pending, []
    for tmp, _ in pending:
      _remove(tmp)


def _stage_one(path, write: Callable[[str], Any], suffix: str | None = None) -> str:
  staged = _Staged()
  staged.stage(path, write, suffix)
  staged.commit()
  return os.fspath(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[str]:
  """Yields a temporary file name beside `path` (hidden, unique, ending in `suffix`, default
  `path`'s extension) for a writer that takes a name; when the block ends without an error
  the file is fsynced and renamed over `path`, on an error it is removed."""
  final = _target(path)
  tmp = _new_temp(final, suffix)
  try:
    yield tmp
    _seal(tmp, final)
    os.replace(tmp, final)
  except BaseException:
    _remove(tmp)
    raise
  _fsync_dir(os.path.dirname(final))


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[Any]:
  """`open(path, mode, **open_kwargs)` onto a temporary file that replaces `path` when the block
  ends without an error (removed on an error). `mode`: a writing mode ("w", "wb", "wt")."""
  if "w" not in mode or any(c in mode for c in "ax+"):
    raise ValueError(f"atomic_write writes a whole file: mode must be 'w' or 'wb', got {mode!r}")
  with atomic_path(path) as tmp:
    with open(tmp, mode, **open_kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())


def _json_writer(obj: Any, dump_kwargs: dict[str, Any]) -> Callable[[str], None]:
  def write(tmp: str) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(obj, f, **dump_kwargs)
  return write


def _text_writer(text: str) -> Callable[[str], None]:
  def write(tmp: str) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
  return write


def _figure_writer(fig, final: str, savefig_kwargs: dict[str, Any]) -> Callable[[str], None]:
  fmt = savefig_kwargs.pop("format", None) or os.path.splitext(final)[1][1:] or None

  def write(tmp: str) -> None:
    fig.savefig(tmp, format=fmt, **savefig_kwargs)
  return write


def write_json(path: str | os.PathLike, obj: Any, **dump_kwargs) -> str:
  """`json.dump(obj, f, **dump_kwargs)` into `path`, atomically (UTF-8); returns `path`."""
  return _stage_one(path, _json_writer(obj, dump_kwargs))


def write_text(path: str | os.PathLike, text: str) -> str:
  """`text` into `path` (UTF-8), atomically; returns `path`."""
  return _stage_one(path, _text_writer(text))


def save_npy(path: str | os.PathLike, array) -> str:
  """`np.save` of `array` into `path` (its name as given: no `.npy` appended), atomically."""
  import numpy as np

  def write(tmp: str) -> None:
    with open(tmp, "wb") as f:
      np.save(f, array)
  return _stage_one(path, write)


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> str:
  """`fig.savefig` into `path`, atomically: the temporary file has `path`'s extension and the
  format is `path`'s unless `format=` says otherwise. Returns `path` as given."""
  return _stage_one(path, _figure_writer(fig, _target(path), dict(savefig_kwargs)))


def save_safetensors(tensors: dict[str, Any], path: str | os.PathLike, *,
                     metadata: dict[str, str] | None = None, framework: str = "numpy") -> str:
  """`safetensors.<framework>.save_file(tensors, path, metadata)`, atomically; framework:
  "numpy" (numpy arrays) or "flax" (JAX arrays)."""
  if framework == "numpy":
    import safetensors.numpy as backend
  elif framework == "flax":
    import safetensors.flax as backend
  else:
    raise ValueError(f"framework must be 'numpy' or 'flax', got {framework!r}")
  return _stage_one(path, lambda tmp: backend.save_file(tensors, tmp, metadata=metadata))


def save_tokenizer(tok, path: str | os.PathLike) -> str:
  """`tok.save(path)` (a `tokenizers.Tokenizer`), atomically."""
  return _stage_one(path, lambda tmp: tok.save(tmp))


class FileGroup:
  """Files that are replaced together (`atomic_group`): each write goes to a temporary file at
  once, and all of them are renamed over their targets only when the group's block ends without
  an error, so a failure while writing any of them leaves every previous file as it was. The
  renames themselves come one after another (each atomic): a process killed among them leaves
  some files new and the rest old, every one of them whole."""

  def __init__(self):
    self._staged = _Staged()

  def write_json(self, path: str | os.PathLike, obj: Any, **dump_kwargs) -> str:
    self._staged.stage(path, _json_writer(obj, dump_kwargs))
    return os.fspath(path)

  def write_text(self, path: str | os.PathLike, text: str) -> str:
    self._staged.stage(path, _text_writer(text))
    return os.fspath(path)

  def save_figure(self, fig, path: str | os.PathLike, **savefig_kwargs) -> str:
    self._staged.stage(path, _figure_writer(fig, _target(path), dict(savefig_kwargs)))
    return os.fspath(path)


@contextlib.contextmanager
def atomic_group() -> Iterator[FileGroup]:
  """A `FileGroup` whose files replace their targets together when the block succeeds; on an
  error none does and their temporary files are removed."""
  group = FileGroup()
  try:
    yield group
  except BaseException:
    group._staged.discard()
    raise
  group._staged.commit()


# -- folders -----------------------------------------------------------------------------------

_SWAP_FALLBACK = {"EBUSY", "EXDEV", "EPERM", "EACCES", "EINVAL"}


def _link_or_copy(src: str, dst: str) -> None:
  try:
    os.link(src, dst)
  except OSError:
    shutil.copy2(src, dst)


def _carry_over(old: str, new: str, drop: Sequence[str]) -> None:
  """Entries of the previous folder `old` that the new export `new` did not write and that no
  `drop` pattern matches, linked (or copied) into `new`."""
  for name in os.listdir(old):
    if name.startswith(".") and _TMP in name:  # a temporary file a killed write left
      continue
    if os.path.lexists(os.path.join(new, name)) or any(fnmatch.fnmatch(name, p) for p in drop):
      continue
    src, dst = os.path.join(old, name), os.path.join(new, name)
    if os.path.isdir(src) and not os.path.islink(src):
      shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    elif os.path.islink(src):
      os.symlink(os.readlink(src), dst)
    else:
      _link_or_copy(src, dst)


def _replace_entries(new: str, final: str) -> None:
  """The fallback where `final` itself cannot be renamed (a mount point, say): each of `new`'s
  top-level files replaces its namesake in `final` (each file atomically, not the folder)."""
  for name in os.listdir(new):
    src, dst = os.path.join(new, name), os.path.join(final, name)
    if os.path.isdir(src) and not os.path.islink(src):
      if os.path.isdir(dst) and not os.path.islink(dst):
        shutil.rmtree(dst)
      elif os.path.lexists(dst):
        os.remove(dst)
    os.replace(src, dst)
  _fsync_dir(final)
  shutil.rmtree(new, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, keep_others: bool = True,
               drop: Sequence[str] = ()) -> Iterator[str]:
  """Yields a new empty folder beside `path` (hidden, unique) to write a whole export into; when
  the block ends without an error it takes `path`'s place, on an error it is removed and `path`
  is untouched.

  keep_others: entries of the previous folder that the export did not write (a tuning record,
  a README) are carried into the new one (hard links where possible), as writing into the
  folder kept them; `drop`: name patterns (fnmatch) never carried over, e.g. the shards of an
  earlier export that the new one would otherwise sit beside.

  The swap is two renames: the previous folder to a hidden backup beside it, then the new one to
  `path`; the backup is then removed. Between the two renames `path` is absent for an instant: a
  process killed exactly there leaves the previous folder whole under its backup name
  (`.<name>.*.old`), and a failed second rename puts it back. Where `path` cannot be renamed (a
  mount point, a folder of another file system) each new file replaces its namesake in `path`
  instead, each atomically."""
  final = _target(path)
  parent, name = os.path.split(final)
  os.makedirs(parent, exist_ok=True)
  if os.path.exists(final) and not os.path.isdir(final):
    raise ValueError(f"{path} exists and is not a folder: an export is written as a folder")
  new = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=_TMP)
  try:
    os.chmod(new, _mode_for(final, 0o777))
    yield new
    if not os.path.isdir(final):
      os.rename(new, final)
      _fsync_dir(parent)
      return
    if keep_others:
      _carry_over(final, new, drop)
    backup = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".old")
    os.rmdir(backup)  # a unique free name: rename the previous folder to it
    try:
      os.rename(final, backup)
    except OSError as e:
      if errno.errorcode.get(e.errno) not in _SWAP_FALLBACK:
        raise
      _replace_entries(new, final)
      return
    try:
      os.rename(new, final)
    except BaseException:
      os.rename(backup, final)
      raise
    _fsync_dir(parent)
    shutil.rmtree(backup, ignore_errors=True)
  finally:
    if os.path.isdir(new):
      shutil.rmtree(new, ignore_errors=True)


def check_output_dir(path: str | os.PathLike, what: str = "output folder", *,
                     overwrite_shipped: bool | None = None) -> str:
  """Creates folder `path` (and its parents) and checks that files can be written into it, so a
  run that would only fail when it saves, after minutes of measuring or training, fails at once.
  ValueError naming `what` and the reason otherwise. Outputs (results, caches, a workdir) never
  go into the shipped assets folder (`assets.check_not_shipped`), unless `overwrite_shipped`
  says whether this one may (`assets.check_writable`: a tool's own flag)."""
  from specjax import assets
  path = os.fspath(path)
  if overwrite_shipped is None:
    assets.check_not_shipped(path, f"the {what}")
  else:
    assets.check_writable(path, overwrite_shipped, f"the {what}")
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"the {what} {path} is a file, not a folder")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"the {what} {path} cannot be created: {e.strerror or e}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"the {what} {path} is not writable")
  return path


def _is_results_json(path: str) -> bool:
  try:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(d, dict) and "provenance" in d


def check_output_file(path: str | os.PathLike, what: str = "output file", *,
                      overwrite_shipped: bool | None = None) -> str:
  """`check_output_dir` for the folder a JSON results file `path` will be written into; `path`
  is not a folder, and an existing file there is one such results file (a rerun replaces its
  own results, never a config or weights named by mistake)."""
  path = os.fspath(path)
  if os.path.isdir(path):
    raise ValueError(f"the {what} {path} is a folder, not a file")
  if os.path.exists(path) and not _is_results_json(path):
    raise ValueError(f"the {what} {path} exists and is not a results file a specjax tool wrote "
                     "(a JSON object with its provenance): choose another name, or remove it")
  check_output_dir(os.path.dirname(os.path.abspath(path)), f"folder of the {what}",
                   overwrite_shipped=overwrite_shipped)
  return path


MODEL = "model"  # an HF model folder (or a published drafter: both are config.json + weights)


def export_kind(path: str | os.PathLike) -> str | None:
  """What an existing export folder holds, by its config.json: "<method> drafter" for a specjax
  drafter folder, `MODEL` for any other config.json (an HF model or a published drafter),
  "weights" for weights without a config, None for an absent or model-free folder."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    return None
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    weights = any(n.endswith((".safetensors", ".bin", ".pt")) for n in os.listdir(path))
    return "weights" if weights else None
  try:
    with open(config, encoding="utf-8") as f:
      d = json.load(f)
  except (OSError, ValueError):
    return MODEL
  if isinstance(d, dict) and "method" in d and "net" in d:
    return f"{d['method']} drafter"
  return MODEL


def check_export_over(path: str | os.PathLike, kind: str, what: str = "the export") -> None:
  """ValueError when folder `path` holds an export of another kind than `kind` (e.g. a target
  model where a drafter is to be written): writing there would replace one model with another,
  which nobody asks for by accident. An absent folder, one without a model, or one of the same
  kind (a retrained drafter, a model saved again) is fine."""
  held = export_kind(path)
  if held is not None and held != kind:
    raise ValueError(f"{what} would replace {os.fspath(path)}, which holds a {held} folder, with "
                     f"a {kind} folder: choose another folder (or remove that one first)")
