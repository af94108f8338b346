"""The LM trainer: exact resume after an interruption, the export, and clear errors on bad input.

A tiny run (a 2-layer Qwen3 on a folder of ~30 stdlib files) exercises the same code path as the
embedded target's training: TFDS build, tokenizer, packing, sequence-length curriculum, orbax
checkpoints, export with `save_hf`.
"""

from __future__ import annotations

import glob
import json
import os

import jax
import numpy as np
import pytest

from specjax.config_utils import load_config
from specjax.train import loop
from specjax.train.target_lm import train_lm
from tests.helpers.corpora import stdlib_source_dir

_TINY = [
    "model.vocab_size=600", "model.num_layers=2", "model.hidden_size=64",
    "model.intermediate_size=128", "model.num_heads=4", "model.num_kv_heads=2",
    "model.head_dim=16", "model.max_position_embeddings=256", "optim.total_steps=16",
    "optim.warmup_steps=3", "seq_len=32", "batch_size=4", "long_steps=4", "long_seq_len=64",
    "eval_every=8", "save_every=5", "eval_rows=8", "export_dtype=float32",
]


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> str:
  """~30 stdlib files, with at least two whose relative path hashes into the held-out split."""
  return stdlib_source_dir(tmp_path_factory.mktemp("src"), ("json", "email"))


@pytest.fixture(scope="module")
def tokenizer_path(source_dir, tmp_path_factory) -> str:
  """One tokenizer shared by the runs below, so they differ only in how they were interrupted."""
  work = tmp_path_factory.mktemp("tok_run")
  cfg = _config(source_dir, work, "optim.total_steps=4", "long_steps=0")
  train_lm(cfg, stop_after=1, progress=False)
  return os.path.join(work, "tokenizer.json")


def _config(source_dir, workdir, *extra, data_dir=None):
  data_dir = data_dir or os.path.join(os.fspath(workdir), "..", "tfds")
  return load_config("configs/target_stdlib.py", _TINY + [
      f"data.source_dir={source_dir}", f"data.data_dir={data_dir}",
      f"workdir={workdir}", f"export_dir={os.path.join(os.fspath(workdir), 'export')}",
      *extra])


def _assert_params_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_after_interruption_is_bitwise_identical(source_dir, tokenizer_path, tmp_path):
  """Stopping after k steps (twice, once inside the long-context phase) and resuming gives the
  parameters of the uninterrupted run bit for bit: saved state, per-step batches and the compiled
  step are all identical, and XLA on CPU is deterministic."""
  tok = f"data.tokenizer_path={tokenizer_path}"
  straight = train_lm(_config(source_dir, tmp_path / "a", tok), progress=False)
  assert straight["finished"] and straight["step"] == 16

  cfg = _config(source_dir, tmp_path / "b", tok)
  first = train_lm(cfg, stop_after=7, progress=False)
  assert not first["finished"] and first["step"] == 7
  second = train_lm(cfg, stop_after=6, progress=False)  # crosses into the long phase (step 12)
  assert second["step"] == 13 and second["resumed_from"] == 7 and first["resumed_from"] is None
  resumed = train_lm(cfg, progress=False)
  assert resumed["finished"] and resumed["step"] == 16
  _assert_params_equal(straight["params"], resumed["params"])
  assert resumed["metadata"]["heldout_loss"] == straight["metadata"]["heldout_loss"]


def test_export_metadata_and_transformers_load(source_dir, tokenizer_path, tmp_path):
  """The export is an HF folder with tokenizer and metadata that transformers loads; the model
  learns something (held-out loss below the uniform log V)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import specjax
  from specjax.models import decoder

  run = train_lm(_config(source_dir, tmp_path, f"data.tokenizer_path={tokenizer_path}"),
                 progress=False)
  export = run["export_dir"]
  meta = json.load(open(os.path.join(export, "metadata.json")))
  assert meta["steps"] == 16 and meta["tokens_seen"] == 16 * 4 * 32
  assert meta["corpus"]["python_version"]
  assert meta["heldout_loss"] < np.log(600)
  assert set(os.listdir(export)) >= {"config.json", "model.safetensors", "tokenizer.json",
                                     "metadata.json"}
  target = specjax.load_target(export)
  hf = transformers.Qwen3ForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
  ids = target.encode("def add(a, b):\n    return a + b\n")
  with torch.no_grad():
    ref = hf(torch.tensor([ids])).logits.numpy()
  ours = decoder.full_forward(target.config, target.params, np.asarray([ids], np.int32)).logits
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


def test_tokenizer_vocab_mismatch_is_refused(source_dir, tokenizer_path, tmp_path):
  cfg = _config(source_dir, tmp_path, f"data.tokenizer_path={tokenizer_path}",
                "model.vocab_size=700")
  with pytest.raises(ValueError, match=r"tokenizer vocabulary \(600\) != model vocab_size \(700\)"):
    train_lm(cfg, progress=False)


def test_corrupt_checkpoint_is_a_clear_error(source_dir, tokenizer_path, tmp_path):
  cfg = _config(source_dir, tmp_path, f"data.tokenizer_path={tokenizer_path}")
  train_lm(cfg, stop_after=5, progress=False)
  step_dir = os.path.join(tmp_path, "checkpoints", "5")
  for path in glob.glob(os.path.join(step_dir, "**", "*"), recursive=True):
    if os.path.isfile(path) and "_METADATA" not in path and os.path.getsize(path) > 0:
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(ValueError, match="checkpoint .*5 is corrupt"):
    train_lm(cfg, progress=False)


def test_missing_checkpoint_folder_is_a_clear_error(tmp_path):
  from specjax.train.checkpoint import Checkpointer
  with Checkpointer(tmp_path / "empty") as ckpt, pytest.raises(ValueError,
                                                             match="no checkpoint to restore"):
    ckpt.restore({"x": np.zeros(2)})


def test_unwritable_data_dir_is_a_clear_error(source_dir, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  cfg = _config(source_dir, tmp_path / "w", data_dir=os.fspath(blocker / "tfds"))
  with pytest.raises(ValueError, match="a_file"):
    train_lm(cfg, progress=False)


def test_a_diverging_run_stops_and_exports_nothing(source_dir, tokenizer_path, tmp_path):
  """A learning rate of 1e30 overflows the weights on the first warmed-up update: the run stops
  with an error naming the first non-finite step, writes no checkpoint past it and no export."""
  cfg = _config(source_dir, tmp_path, f"data.tokenizer_path={tokenizer_path}",
                "optim.learning_rate=1e30")
  with pytest.raises(loop.NonFiniteError, match=r"non-finite at step 3 of 16, so nothing is "
                     "exported; no checkpoint was saved before it") as info:
    train_lm(cfg, progress=False)
  # the loss or its gradient first (on CPU the gradient: normalised activations keep the loss
  # finite a step longer), before the params are ever checked
  assert info.value.step == 3 and info.value.what and "parameters" not in info.value.what
  assert not os.path.exists(tmp_path / "export")
  assert not glob.glob(os.path.join(tmp_path, "checkpoints", "[0-9]*"))
