"""`specjax.files`: every write goes to a temporary file (or folder) beside its target and is
renamed over it only when complete, so a failed write (a full disk, an exception midway) leaves
the previous file byte for byte as it was, and no temporary file behind."""

from __future__ import annotations

import errno
import json
import os
import stat

import numpy as np
import pytest

from specjax import files


def _full_disk(*_, **__):
  raise OSError(errno.ENOSPC, "No space left on device")


def _snapshot(folder) -> dict[str, bytes]:
  """Every file under `folder` (relative path -> bytes)."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = f.read()
  return out


def _previous(tmp_path, name="out.json", content=b'{"previous": true}\n'):
  path = tmp_path / name
  path.write_bytes(content)
  return path, content


def _only(tmp_path, *names):
  assert sorted(os.listdir(tmp_path)) == sorted(names), "a temporary file was left behind"


# -- single files ------------------------------------------------------------------------------


def test_atomic_write_half_written_then_full_disk_keeps_the_previous_file(tmp_path):
  path, before = _previous(tmp_path)
  with pytest.raises(OSError, match="No space left"):
    with files.atomic_write(path, "w") as f:
      f.write('{"new": ')  # half the file, then the disk is full
      _full_disk()
  assert path.read_bytes() == before
  _only(tmp_path, "out.json")
  with files.atomic_write(path, "wb") as f:
    f.write(b"new bytes")
  assert path.read_bytes() == b"new bytes"
  _only(tmp_path, "out.json")
  with pytest.raises(ValueError, match="mode"):
    with files.atomic_write(path, "a"):
      pass


def test_write_json_failing_midway_or_at_the_rename(tmp_path, monkeypatch):
  path, before = _previous(tmp_path)

  def half_dump(obj, f, **kwargs):
    f.write(json.dumps(obj, **kwargs)[:5])
    _full_disk()

  with monkeypatch.context() as m:
    m.setattr(json, "dump", half_dump)
    with pytest.raises(OSError, match="No space left"):
      files.write_json(path, {"new": 1})
  assert path.read_bytes() == before
  _only(tmp_path, "out.json")
  with pytest.raises(TypeError):  # not serialisable, after part of the file was written
    files.write_json(path, {"a": list(range(1000)), "b": object()})
  assert path.read_bytes() == before
  _only(tmp_path, "out.json")
  with monkeypatch.context() as m:
    m.setattr(os, "replace", _full_disk)
    with pytest.raises(OSError):
      files.write_json(path, {"new": 1})
  assert path.read_bytes() == before
  _only(tmp_path, "out.json")
  assert files.write_json(path, {"new": 1}, indent=1) == os.fspath(path)
  assert json.loads(path.read_text()) == {"new": 1}
  _only(tmp_path, "out.json")


def test_write_text_failing_at_fsync_keeps_the_previous_file(tmp_path, monkeypatch):
  """A full disk often shows only when the data is flushed (delayed allocation)."""
  path, before = _previous(tmp_path, "table.md", b"previous table\n")
  with monkeypatch.context() as m:
    m.setattr(os, "fsync", _full_disk)
    with pytest.raises(OSError, match="No space left"):
      files.write_text(path, "new table\n")
  assert path.read_bytes() == before
  _only(tmp_path, "table.md")
  files.write_text(path, "new table ü\n")
  assert path.read_text(encoding="utf-8") == "new table ü\n"


def test_permissions_are_kept_and_new_files_get_the_umask_ones(tmp_path):
  path, _ = _previous(tmp_path)
  os.chmod(path, 0o640)
  files.write_text(path, "x")
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
  umask = os.umask(0o022)
  os.umask(umask)
  files.write_text(tmp_path / "new.txt", "x")
  assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == 0o666 & ~umask


def test_a_symlinked_target_is_written_through_the_link(tmp_path):
  real, _ = _previous(tmp_path, "real.json")
  os.symlink(real, tmp_path / "link.json")
  files.write_json(tmp_path / "link.json", [1])
  assert os.path.islink(tmp_path / "link.json") and json.loads(real.read_text()) == [1]


def test_save_npy(tmp_path, monkeypatch):
  path = tmp_path / "rows.npy"
  files.save_npy(path, np.arange(3))
  before = path.read_bytes()
  with monkeypatch.context() as m:
    m.setattr(os, "replace", _full_disk)
    with pytest.raises(OSError):
      files.save_npy(path, np.arange(5))
  assert path.read_bytes() == before
  _only(tmp_path, "rows.npy")
  files.save_npy(path, np.arange(5))
  np.testing.assert_array_equal(np.load(path), np.arange(5))


def test_save_figure_failing_midway_and_the_format_of_the_name(tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots()
  ax.plot([0, 1], [1, 0])
  path = tmp_path / "plot.png"
  files.save_figure(fig, path, dpi=50)
  before = path.read_bytes()
  assert before.startswith(b"\x89PNG")
  seen = []

  def half_savefig(name, **kwargs):
    seen.append((name, kwargs.get("format")))
    with open(name, "wb") as f:
      f.write(before[:10])
    _full_disk()

  monkeypatch.setattr(fig, "savefig", half_savefig)
  with pytest.raises(OSError, match="No space left"):
    files.save_figure(fig, path, dpi=50)
  assert path.read_bytes() == before
  _only(tmp_path, "plot.png")
  (name, fmt), = seen
  assert name.endswith(".png") and os.path.dirname(name) == str(tmp_path) and fmt == "png"
  monkeypatch.undo()
  files.save_figure(fig, tmp_path / "plot.svg")
  assert b"<svg" in (tmp_path / "plot.svg").read_bytes()[:500]
  plt.close(fig)


@pytest.mark.parametrize("framework", ["numpy", "flax"])
def test_save_safetensors_failing_midway(tmp_path, monkeypatch, framework):
  import importlib

  from safetensors.numpy import load_file
  backend = importlib.import_module(f"safetensors.{framework}")
  path = tmp_path / "model.safetensors"
  files.save_safetensors({"w": np.ones(4, np.float32)}, path, metadata={"format": "pt"},
                         framework=framework)
  before = path.read_bytes()

  def half_save(tensors, name, metadata=None):
    with open(name, "wb") as f:
      f.write(before[:len(before) // 2])
    _full_disk()

  with monkeypatch.context() as m:
    m.setattr(backend, "save_file", half_save)
    with pytest.raises(OSError, match="No space left"):
      files.save_safetensors({"w": np.zeros(4, np.float32)}, path, framework=framework)
  assert path.read_bytes() == before
  _only(tmp_path, "model.safetensors")
  files.save_safetensors({"w": np.zeros(4, np.float32)}, path, framework=framework)
  np.testing.assert_array_equal(load_file(path)["w"], np.zeros(4, np.float32))
  with pytest.raises(ValueError, match="framework"):
    files.save_safetensors({}, path, framework="torch")


def test_save_tokenizer_failing_midway(tmp_path):
  path, before = _previous(tmp_path, "tokenizer.json")

  class HalfTokenizer:
    def save(self, name):
      with open(name, "w") as f:
        f.write('{"model": ')
      _full_disk()

  class Tokenizer:
    def save(self, name):
      with open(name, "w") as f:
        f.write("{}")

  with pytest.raises(OSError, match="No space left"):
    files.save_tokenizer(HalfTokenizer(), path)
  assert path.read_bytes() == before
  _only(tmp_path, "tokenizer.json")
  files.save_tokenizer(Tokenizer(), path)
  assert path.read_text() == "{}"


def test_atomic_group_replaces_all_or_none(tmp_path, monkeypatch):
  a, a_before = _previous(tmp_path, "a.json")
  b, b_before = _previous(tmp_path, "b.md", b"previous b\n")
  calls = []
  real_fsync = os.fsync

  def fsync_fails_second(fd):
    calls.append(fd)
    if len(calls) == 2:
      _full_disk()
    real_fsync(fd)

  with monkeypatch.context() as m:
    m.setattr(os, "fsync", fsync_fails_second)
    with pytest.raises(OSError, match="No space left"):
      with files.atomic_group() as group:
        group.write_json(a, {"new": 1})
        group.write_text(b, "new b\n")
  assert a.read_bytes() == a_before and b.read_bytes() == b_before
  _only(tmp_path, "a.json", "b.md")
  with pytest.raises(RuntimeError):
    with files.atomic_group() as group:
      group.write_json(a, {"new": 1})
      raise RuntimeError("the caller fails after the first file")
  assert a.read_bytes() == a_before
  _only(tmp_path, "a.json", "b.md")
  with files.atomic_group() as group:
    group.write_json(a, {"new": 1})
    group.write_text(b, "new b\n")
    assert a.read_bytes() == a_before  # nothing replaced before the block ends
  assert json.loads(a.read_text()) == {"new": 1} and b.read_text() == "new b\n"
  _only(tmp_path, "a.json", "b.md")


# -- folders -----------------------------------------------------------------------------------


def _export(folder, text):
  files.write_text(os.path.join(folder, "config.json"), text)
  files.write_text(os.path.join(folder, "model-00001-of-00002.safetensors"), text)


def test_atomic_dir_failing_midway_keeps_the_previous_folder(tmp_path):
  final = tmp_path / "export"
  with files.atomic_dir(final) as out:
    assert os.path.dirname(out) == str(tmp_path) and os.listdir(out) == []
    _export(out, "one")
  (final / "README.md").write_text("the user's")
  before = _snapshot(final)
  with pytest.raises(OSError, match="No space left"):
    with files.atomic_dir(final) as out:
      files.write_text(os.path.join(out, "config.json"), "two")
      _full_disk()
  assert _snapshot(final) == before
  _only(tmp_path, "export")
  # A success swaps the folder in: other files kept, `drop` ones not carried over.
  with files.atomic_dir(final, drop=("model-*-of-*.safetensors",)) as out:
    files.write_text(os.path.join(out, "config.json"), "two")
  assert _snapshot(final) == {"config.json": b"two", "README.md": b"the user's"}
  _only(tmp_path, "export")
  with files.atomic_dir(final, keep_others=False) as out:
    files.write_text(os.path.join(out, "config.json"), "three")
  assert _snapshot(final) == {"config.json": b"three"}
  _only(tmp_path, "export")
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="exists and is not a folder"):
    with files.atomic_dir(tmp_path / "file"):
      pass


def test_atomic_dir_failing_second_rename_puts_the_previous_folder_back(tmp_path, monkeypatch):
  final = tmp_path / "export"
  with files.atomic_dir(final) as out:
    _export(out, "one")
  before = _snapshot(final)
  real_rename = os.rename

  def rename(src, dst):
    if os.fspath(dst) == str(final):
      if ".old" not in os.path.basename(os.fspath(src)):
        _full_disk()  # the new folder's rename
    real_rename(src, dst)

  monkeypatch.setattr(os, "rename", rename)
  with pytest.raises(OSError, match="No space left"):
    with files.atomic_dir(final) as out:
      _export(out, "two")
  assert _snapshot(final) == before
  _only(tmp_path, "export")


def test_atomic_dir_falls_back_to_file_by_file_where_the_folder_cannot_move(tmp_path,
                                                                            monkeypatch):
  """A mount point cannot be renamed (EBUSY): each file is then replaced in place."""
  final = tmp_path / "export"
  with files.atomic_dir(final) as out:
    _export(out, "one")
  real_rename = os.rename

  def rename(src, dst):
    if os.fspath(src) == str(final):
      raise OSError(errno.EBUSY, "Device or resource busy")
    real_rename(src, dst)

  monkeypatch.setattr(os, "rename", rename)
  with files.atomic_dir(final) as out:
    files.write_text(os.path.join(out, "config.json"), "two")
  assert _snapshot(final) == {"config.json": b"two",
                              "model-00001-of-00002.safetensors": b"one"}
  _only(tmp_path, "export")


# -- the writers that use them -----------------------------------------------------------------


def _results_records():
  from specjax.lab.records import AR, finish
  from tests.helpers.records import record
  records = []
  for method, draft, verify in ((AR, 0.0, 4.0), ("eagle", 1.0, 6.0)):
    records.append(record(
        method=method, dataset="d", tau=2.0, tokens_per_second=100.0,
        tokens_per_second_repeats=[100.0], target_calls=16, new_tokens=32,
        outputs=[[1], [2]], draft_nodes=4, t_prefill_ms=5.0,
        t_prefill_spread_ms=0.1, t_draft_ms=draft, prefill_chunks=2,
        prefill_chunks_timed=1, t_draft_spread_ms=0.1, t_verify_ms=verify,
        t_verify_spread_ms=0.1, acceptance_by_depth=[] if method == AR else [0.8, 0.5]))
  finish(records)
  return records


def test_benchmark_results_failing_at_the_second_file_keep_the_previous_results(tmp_path,
                                                                                monkeypatch):
  """results.json, results.md and the plots are replaced together: a full disk while writing
  results.md leaves the previous results.json parseable and every previous file as it was."""
  from specjax import provenance
  from specjax.lab import benchmark
  cfg = benchmark.BenchmarkConfig(out=str(tmp_path / "out"), datasets=("humaneval",))
  records = _results_records()
  block = provenance.collect(cfg)
  written = benchmark.write_results(cfg, records, dict(block, run=1))
  names = ["results.json", "results.md", "acceptance_by_depth.png", "speedup.png"]
  assert [os.path.basename(p) for p in written] == names
  before = _snapshot(tmp_path / "out")
  assert sorted(before) == sorted(names)
  real = files._text_writer

  def full_disk_midway(text):
    def write(tmp):
      real(text[:len(text) // 2])(tmp)
      _full_disk()
    return write

  monkeypatch.setattr(files, "_text_writer", full_disk_midway)
  with pytest.raises(OSError, match="No space left"):
    benchmark.write_results(cfg, records, dict(block, run=2))
  assert _snapshot(tmp_path / "out") == before
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  assert saved["provenance"]["run"] == 1 and len(saved["records"]) == 2
  monkeypatch.undo()
  benchmark.write_results(cfg, records, dict(block, run=2))
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  assert saved["provenance"]["run"] == 2
  assert sorted(os.listdir(tmp_path / "out")) == sorted(names)


def test_save_drafter_failing_mid_export_keeps_the_previous_folder_loadable(tmp_path,
                                                                            monkeypatch):
  from specjax.drafters import io
  from tests.helpers import tiny_targets
  target = tiny_targets.greedy_target()
  drafter = io.init_drafter("medusa", target)
  path = tmp_path / "medusa"

  def save(metadata=None):
    io.save_drafter(path, "medusa", drafter.net, drafter.params, drafter.d2t, target.config,
                    metadata=metadata)

  save({"run": 1})
  (path / "tune_tree.json").write_text("{}")
  before = _snapshot(path)
  real = files.write_json

  def fail_at_config(file, obj, **kwargs):
    if os.path.basename(file) == io.CONFIG:
      _full_disk()
    return real(file, obj, **kwargs)

  with monkeypatch.context() as m:  # the weights are written, then the disk is full
    m.setattr(files, "write_json", fail_at_config)
    with pytest.raises(OSError, match="No space left"):
      save({"run": 2})
  assert _snapshot(path) == before
  _only(tmp_path, "medusa")
  io.load_drafter(path, target)
  save()  # no metadata this time: the previous run's is not left beside the new weights
  assert sorted(os.listdir(path)) == [io.CONFIG, "model.safetensors", "tune_tree.json"]
  io.set_default_tree(path, choices=[[0]])
  assert io.read_config(path)["tree"] == {"choices": [[0]]}
  _only(tmp_path, "medusa")


def test_save_hf_failing_mid_export_keeps_the_previous_folder_loadable(tmp_path, monkeypatch):
  import specjax
  from tests.helpers import tiny_targets
  target = tiny_targets.greedy_target()
  path = tmp_path / "hf"
  specjax.save_hf(target, path, max_shard_bytes=1 << 12, extra_files={"metadata.json": "{}"})
  assert any(n.startswith("model-00001-of-") for n in os.listdir(path))
  before = _snapshot(path)
  real = files.write_text

  def fail_at_extra(file, text):
    if os.path.basename(file) == "metadata.json":
      _full_disk()
    return real(file, text)

  with monkeypatch.context() as m:  # every weight file is written, then the disk is full
    m.setattr(files, "write_text", fail_at_extra)
    with pytest.raises(OSError, match="No space left"):
      specjax.save_hf(target, path, extra_files={"metadata.json": "{}"})
  assert _snapshot(path) == before
  _only(tmp_path, "hf")
  specjax.load_target(path)
  specjax.save_hf(target, path)  # one file now: the earlier shards and index do not linger
  assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "metadata.json",
                                      "model.safetensors"]
  loaded = specjax.load_target(path)
  assert loaded.config.vocab_size == target.config.vocab_size
