"""The shipped target and drafters (specjax/assets) change only when asked to: every writer that
can write there refuses a path inside the folder (relative, or through a symbolic link) before
writing anything, unless given `overwrite_shipped=True` (`--overwrite-shipped` on the command
line); results folders are never written there."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

import specjax
from specjax import assets
from specjax.drafters import io
from tests.helpers import tiny_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assets_state() -> dict[str, str]:
  """Every file under the shipped folder: name -> (size, mtime, sha256 of the small ones)."""
  out = {}
  for root, dirs, names in os.walk(assets.ASSETS_DIR):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    for name in names:
      path = os.path.join(root, name)
      st = os.stat(path)
      digest = ""
      if st.st_size < 1 << 20:
        with open(path, "rb") as f:
          digest = hashlib.sha256(f.read()).hexdigest()
      out[os.path.relpath(path, assets.ASSETS_DIR)] = f"{st.st_size}:{st.st_mtime_ns}:{digest}"
  return out


@pytest.fixture(scope="module")
def target():
  """A tiny target with the shipped tokenizer (write_tokenizer_config describes it)."""
  from specjax.interop.tokenizer import load_tokenizer
  return tiny_targets.greedy_target().replace(tokenizer=load_tokenizer(assets.TARGET_DIR))


@pytest.fixture(scope="module")
def drafter(target):
  return io.init_drafter("medusa", target)


def _writers(target, drafter):
  """name -> a call writing into folder `path` (overwrite_shipped passed on)."""
  return {
      "save_drafter": lambda path, **kw: io.save_drafter(
          path, "medusa", drafter.net, drafter.params, drafter.d2t, target.config, **kw),
      "set_default_tree": lambda path, **kw: io.set_default_tree(path, choices=[[0]], **kw),
      "export_drafter": lambda path, **kw: io.export_drafter(path, drafter, target, "medusa",
                                                             **kw),
      "save_hf": lambda path, **kw: specjax.save_hf(target, path, **kw),
      "write_tokenizer_config": lambda path, **kw: specjax.interop.hf.write_tokenizer_config(
          target, path, **kw),
  }


WRITERS = ["save_drafter", "set_default_tree", "export_drafter", "save_hf",
           "write_tokenizer_config"]


@pytest.mark.parametrize("name", WRITERS)
def test_library_writers_refuse_the_shipped_folder(name, target, drafter, tmp_path,
                                                   monkeypatch):
  write = _writers(target, drafter)[name]
  before = _assets_state()
  shipped = "specjax/assets/target" if name in ("save_hf", "write_tokenizer_config") else (
      "specjax/assets/medusa")
  monkeypatch.chdir(ROOT)  # a relative path
  with pytest.raises(assets.ShippedAssetError) as e:
    write(shipped)
  message = str(e.value)
  assert shipped in message and os.path.realpath(assets.ASSETS_DIR) in message
  assert "--overwrite-shipped" in message and "overwrite_shipped=True" in message
  link = tmp_path / "link"  # through a symbolic link
  os.symlink(os.path.join(assets.ASSETS_DIR, os.path.basename(shipped)), link)
  with pytest.raises(assets.ShippedAssetError):
    write(link)
  assert _assets_state() == before


@pytest.mark.parametrize("name", WRITERS)
def test_the_flag_lets_a_writer_through(name, target, drafter, tmp_path, monkeypatch):
  """On a stand-in shipped folder: refused without the flag, written with it."""
  monkeypatch.setattr(assets, "ASSETS_DIR", str(tmp_path / "assets"))
  folder = tmp_path / "assets" / "medusa"
  if name == "save_hf":  # a model folder: save_hf never replaces a drafter's
    specjax.save_hf(target, folder, overwrite_shipped=True)
  else:
    io.save_drafter(folder, "medusa", drafter.net, drafter.params, drafter.d2t, target.config,
                    overwrite_shipped=True)  # set_default_tree needs a folder to change
  def state():  # a replaced file is a new inode, even with the same bytes
    return {n: (os.stat(folder / n).st_ino, (folder / n).read_bytes())
            for n in os.listdir(folder)}

  before = state()
  write = _writers(target, drafter)[name]
  with pytest.raises(assets.ShippedAssetError):
    write(folder)
  assert state() == before
  write(folder, overwrite_shipped=True)
  assert state() != before
  shutil.copytree(folder, tmp_path / "elsewhere")
  write(tmp_path / "elsewhere")  # outside the folder: no flag needed


def test_check_writable_and_check_not_shipped(tmp_path):
  inside = os.path.join(assets.ASSETS_DIR, "eagle")
  assets.check_writable(tmp_path, False, "x")
  assets.check_writable(inside, True, "x")
  with pytest.raises(ValueError, match="--overwrite-shipped"):
    assets.check_writable(os.path.join(inside, "..", "eagle3"), False, "the drafter folder")
  with pytest.raises(ValueError, match="write it elsewhere") as e:
    assets.check_not_shipped(inside, "the results folder (out)")
  assert "--overwrite-shipped" not in str(e.value)
  assert not assets.is_shipped(os.path.dirname(assets.ASSETS_DIR))


def test_train_drafter_refuses_a_shipped_export_dir_before_training(capsys, monkeypatch):
  """`--set export_dir=specjax/assets/eagle` without --overwrite-shipped: a usage error (status
  2, one line naming the flag) before the target is even loaded."""
  from experiments import train_drafter
  from specjax.train import drafter as trainer
  monkeypatch.setattr(trainer, "_load_target", lambda cfg: pytest.fail("training started"))
  before = _assets_state()
  monkeypatch.chdir(ROOT)
  with pytest.raises(SystemExit) as e:
    train_drafter.main(["--config", "configs/eagle_stdlib.py", "--no-compile-cache",
                        "--set", "export_dir=specjax/assets/eagle"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: export_dir specjax/assets/eagle is inside the shipped assets")
  assert "--overwrite-shipped" in err and err.count("\n") == 1
  assert _assets_state() == before


def test_train_lm_refuses_a_shipped_export_dir_before_training(tmp_path, monkeypatch):
  from specjax.config_utils import load_config
  from specjax.train import target_lm
  monkeypatch.setattr(target_lm, "training_mesh", lambda cfg: pytest.fail("training started"))
  cfg = load_config(os.path.join(ROOT, "configs", "target_stdlib.py"),
                    [f"workdir={tmp_path / 'run'}",
                     f"export_dir={os.path.join(assets.ASSETS_DIR, 'target')}"])
  with pytest.raises(assets.ShippedAssetError, match="export_dir"):
    target_lm.train_lm(cfg, progress=False)
  assert not os.path.exists(tmp_path / "run")


def test_the_trainer_cli_passes_the_flag_on(monkeypatch, capsys):
  from specjax import cli
  seen = {}

  def train(cfg, *, stop_after, overwrite_shipped):
    seen.update(stop_after=stop_after, overwrite_shipped=overwrite_shipped)
    return {"finished": False, "step": 0}

  monkeypatch.chdir(ROOT)
  cli.train_main("t", train, (), argv=["--config", "configs/eagle_stdlib.py",
                                       "--no-compile-cache", "--overwrite-shipped"])
  assert seen == {"stop_after": None, "overwrite_shipped": True}


def test_tune_tree_refuses_a_shipped_path_before_measuring(capsys, monkeypatch):
  from experiments import tune_tree
  monkeypatch.setattr(tune_tree, "sweep_trees", lambda *a, **k: pytest.fail("measured"))
  monkeypatch.setattr(tune_tree.cli, "mesh_from_args", lambda a: pytest.fail("JAX started"))
  before = _assets_state()
  monkeypatch.chdir(ROOT)
  for argv in (["--save", "--path", "specjax/assets/medusa"],
               ["--out", "specjax/assets/medusa/tune_tree.json"]):
    with pytest.raises(SystemExit) as e:
      tune_tree.main(["--method", "medusa", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "is inside the shipped assets folder" in err and "--overwrite-shipped" in err
  assert _assets_state() == before


def test_results_are_never_written_into_the_shipped_folder(tmp_path, monkeypatch):
  from specjax.lab import benchmark, reproduce
  monkeypatch.setattr(benchmark, "configured_target", lambda cfg: pytest.fail("measured"))
  before = _assets_state()
  out = os.path.join(assets.ASSETS_DIR, "results")
  with pytest.raises(assets.ShippedAssetError, match="write it elsewhere"):
    benchmark.run(benchmark.BenchmarkConfig(out=out))
  with pytest.raises(assets.ShippedAssetError, match="write it elsewhere"):
    benchmark.write_results(benchmark.BenchmarkConfig(out=out), [], {})
  with pytest.raises(assets.ShippedAssetError, match="write it elsewhere"):
    reproduce.run(["methods"], reproduce.ReproduceConfig(out=out))
  assert _assets_state() == before and not os.path.exists(out)
