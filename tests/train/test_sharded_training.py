"""Sharded training: the LM and drafter trainers on a device mesh, checkpoints across meshes.

The session has 8 CPU devices (tests/conftest.py). On a mesh the trainers compute what they
compute on one device, up to float rounding (reductions are split and ordered differently);
a checkpoint written on dp=4,tp=2 restores bit for bit onto one device and onto a 4-device mesh,
laid out as asked; a resume on the same mesh is bit-exact. The LM runs reuse the shipped
target's tokenizer (no tokenizer training) and stop before the export; the loop-level tests use
a tiny decoder on random tokens.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import train_target
from specjax import assets, sharding
from specjax.config_utils import load_config, parse_assignment
from specjax.data.pipeline import LMBatch
from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.train import loop
from specjax.train.checkpoint import Checkpointer
from specjax.train.drafter import train_drafter
from specjax.train.optim import OptimConfig, make_optimizer
from specjax.train.target_lm import lm_loss, train_lm
from tests.helpers import tiny_targets
from tests.helpers.corpora import stdlib_source_dir

TOKENIZER = os.path.join(assets.TARGET_DIR, "tokenizer.json")
VOCAB = 8192  # the shipped tokenizer's

_LM = [
    f"model.vocab_size={VOCAB}", "model.num_layers=2", "model.hidden_size=32",
    "model.intermediate_size=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.head_dim=8", "model.max_position_embeddings=64", "optim.total_steps=30",
    "optim.warmup_steps=3", "seq_len=32", "batch_size=8", "long_steps=0", "log_every=1",
    "eval_every=1000", "save_every=1000", "eval_rows=8", f"data.tokenizer_path={TOKENIZER}",
]

# The loop-level model: every dimension divides tp=2 (KV heads split too).
CFG = ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                  max_position_embeddings=64)
STEPS = 4
Q_PROJ = ("layers", 0, "self_attn", "q_proj", "kernel")


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> str:
  return stdlib_source_dir(tmp_path_factory.mktemp("src"), ("json",))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  """One TFDS data dir for the module: the corpus is built once."""
  return os.fspath(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def lm_overrides(source_dir, data_dir):
  """`(workdir, *extra) -> the --set items of a tiny LM run`."""
  def overrides(workdir, *extra) -> list[str]:
    return _LM + [f"data.source_dir={source_dir}", f"data.data_dir={data_dir}",
                  f"workdir={workdir}", *extra]
  return overrides


def _lm_config(overrides: list[str]):
  return load_config("configs/target_stdlib.py", overrides)


def _mesh(spec: str, n: int | None = None):
  return sharding.make_mesh(spec, devices=None if n is None else jax.devices()[:n])


def _leaf(tree, path):
  for k in path:
    tree = tree[k]
  return tree[...] if isinstance(tree, nnx.Variable) else tree


def _losses(history) -> np.ndarray:
  return np.array([r["loss"] for r in history if "loss" in r])


def _assert_tree_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.array_equal(np.asarray(x), np.asarray(y))


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _assert_split_over_model(x, tp: int, dim: int = 1):
  """Each device holds 1/tp of `x` along `dim` (a column-parallel kernel)."""
  assert x.sharding.spec[dim] == sharding.MODEL
  for shard in x.addressable_shards:
    expect = list(x.shape)
    expect[dim] //= tp
    assert shard.data.shape == tuple(expect)


# -- the LM trainer ---------------------------------------------------------------------------


def test_cli_mesh_override_keeps_everything_after_the_first_equals():
  assert parse_assignment("mesh=dp=4,tp=2") == ("mesh", "dp=4,tp=2")
  assert load_config("configs/target_stdlib.py", ["mesh=dp=4,tp=2"]).mesh == "dp=4,tp=2"
  assert load_config("configs/eagle_stdlib.py", ["mesh=tp=2,dp=-1"]).mesh == "tp=2,dp=-1"
  assert load_config("configs/target_stdlib.py", ["mesh=none"]).mesh is None
  assert "mesh" in loop.NOT_RUN_SETTINGS


def test_lm_on_dp4_tp2_matches_one_device(lm_overrides, tmp_path):
  """20 steps of the LM trainer on dp=4,tp=2, started from the command line with `--set
  mesh=dp=4,tp=2`, give the loss curve of one device; the params come back tensor parallel.
  The workdir's run config lets it resume on another mesh."""
  one = train_lm(_lm_config(lm_overrides(tmp_path / "one")), stop_after=20, progress=False)
  argv = ["--config", "configs/target_stdlib.py", "--stop-after", "20"]
  for item in lm_overrides(tmp_path / "mesh", "mesh=dp=4,tp=2"):
    argv += ["--set", item]
  sharded = train_target.main(argv)
  assert one["step"] == sharded["step"] == 20 and not sharded["finished"]
  assert len(_losses(one["history"])) == 20
  np.testing.assert_allclose(_losses(sharded["history"]), _losses(one["history"]), rtol=1e-5)
  kernel = _leaf(sharded["params"], Q_PROJ)
  assert kernel.sharding.mesh.shape == {"data": 4, "model": 2}
  _assert_split_over_model(kernel, tp=2)
  _assert_tree_close(sharded["params"], one["params"], rtol=1e-4, atol=1e-5)
  # The workdir may be resumed on another mesh (the loop tests below do): `mesh` is not among
  # the settings a resume must repeat, the others still are.
  workdir = os.fspath(tmp_path / "mesh")
  loop.check_run_config(workdir, _lm_config(lm_overrides(workdir, "mesh=dp=8")))
  with pytest.raises(ValueError, match=r"seed: 0 -> 1"):
    loop.check_run_config(workdir, _lm_config(lm_overrides(workdir, "mesh=dp=8", "seed=1")))


def test_lm_bad_mesh_and_batch_are_refused_before_any_work(lm_overrides, tmp_path):
  def run(*extra):
    train_lm(_lm_config(lm_overrides(tmp_path / "w", *extra)), progress=False)

  with pytest.raises(ValueError, match=r"'dp=3,tp=2' needs 6 devices, but 8 are available"):
    run("mesh=dp=3,tp=2")
  with pytest.raises(ValueError, match=r"batch_size 6 is not a multiple of the data axis .*dp=4"):
    run("mesh=dp=4,tp=2", "batch_size=6")
  with pytest.raises(ValueError, match=r"long-phase batch size .* 2 is not a multiple .*dp=4"):
    run("mesh=dp=4,tp=2", "long_steps=4", "long_seq_len=64", "batch_size=4")
  with pytest.raises(ValueError, match=r"num_attention_heads 4 .* model axis \(8\)"):
    run("mesh=tp=8")
  assert not os.path.exists(tmp_path / "w")  # nothing was written


# -- the drafter trainer ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
  """A tiny random target (scaled: structured logits) with the shipped tokenizer."""
  from specjax.interop.tokenizer import load_tokenizer
  target = tiny_targets.scaled_target(tiny_targets.config(VOCAB), seed=0)
  return target.replace(tokenizer=load_tokenizer(TOKENIZER))


def _drafter_config(source_dir, data_dir, workdir, *extra):
  return load_config("configs/eagle_stdlib.py", [
      "optim.total_steps=4", "optim.warmup_steps=1", "seq_len=32", "batch_size=4",
      "eval_every=1000", "save_every=1000", "eval_rows=4", "draft_vocab_size=256",
      "source=corpus", "log_every=1", f"source_dir={source_dir}", f"data_dir={data_dir}",
      f"workdir={workdir}", *extra])


def test_eagle_drafter_on_a_mesh_matches_one_device(source_dir, data_dir, tiny_target,
                                                     tmp_path):
  """EAGLE against a tiny target: 3 steps on dp=4,tp=2 follow the single-device losses, and the
  drafter's params and the frozen target lie on the mesh. A batch that dp does not divide is
  refused before any work."""
  one = train_drafter(_drafter_config(source_dir, data_dir, tmp_path / "one"), stop_after=3,
                      progress=False, target=tiny_target)
  sharded = train_drafter(
      _drafter_config(source_dir, data_dir, tmp_path / "mesh", "mesh=dp=4,tp=2"), stop_after=3,
      progress=False, target=tiny_target)
  assert len(_losses(one["history"])) == 3
  np.testing.assert_allclose(_losses(sharded["history"]), _losses(one["history"]), rtol=1e-5)
  _assert_tree_close(sharded["params"], one["params"], rtol=1e-4, atol=1e-5)
  devices = {d for x in jax.tree.leaves(sharded["params"]) for d in x.sharding.device_set}
  assert len(devices) == 8
  kernel = _leaf(sharded["params"], ("layer", "q_proj", "kernel"))
  _assert_split_over_model(kernel, tp=2)
  with pytest.raises(ValueError, match=r"batch_size 2 is not a multiple .*dp=4"):
    train_drafter(_drafter_config(source_dir, data_dir, tmp_path / "bad", "mesh=dp=4,tp=2",
                                  "batch_size=2"), progress=False, target=tiny_target)
  assert not os.path.exists(tmp_path / "bad")


# -- the loop: sharded state, checkpoints across meshes, exact resume -------------------------


def _batches(start: int):
  for step in range(start, 10**6):
    tokens = np.random.default_rng(step).integers(0, CFG.vocab_size, (8, 17)).astype(np.int32)
    yield LMBatch(inputs=tokens[:, :-1], targets=tokens[:, 1:])


def _tx():
  return make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1, total_steps=STEPS))


def _train(workdir=None, mesh=None, stop_after=None, batches=_batches):
  params = decoder.init_params(CFG, 0)
  shardings = None if mesh is None else sharding.param_shardings(CFG, params, mesh)
  return loop.train(lambda p, b: lm_loss(CFG, p, b), params, _tx(), batches,
                    loop.LoopConfig(total_steps=STEPS, log_every=1, save_every=100),
                    workdir=None if workdir is None else os.fspath(workdir),
                    stop_after=stop_after, progress=False, mesh=mesh, param_shardings=shardings)


def _state_like(mesh=None):
  params = decoder.init_params(CFG, 1)  # other values: the restore must overwrite them
  shardings = None if mesh is None else sharding.param_shardings(CFG, params, mesh)
  return loop.initial_state(params, _tx(), mesh=mesh, param_shardings=shardings)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted run on dp=4,tp=2, and one stopped at step 2 (its workdir holds the
  checkpoint of step 2)."""
  workdir = tmp_path_factory.mktemp("interrupted")
  mesh = _mesh("dp=4,tp=2")
  return {"straight": _train(mesh=mesh), "first": _train(workdir, mesh=mesh, stop_after=2),
          "workdir": workdir}


def test_state_is_sharded_like_the_params():
  """On dp=4,tp=2 the q_proj kernel and Adam's mu and nu of it are split over `model` (each
  device holds half its columns), the step counts are replicated, and a kernel's bytes per
  device are 1/tp of it."""
  mesh = _mesh("dp=4,tp=2")
  state = _state_like(mesh)
  kernel = _leaf(state["params"], Q_PROJ)
  _assert_split_over_model(kernel, tp=2)
  adam = state["opt_state"][1][0]  # clip_by_global_norm, then adamw's (scale_by_adam, ...)
  for moment in (adam.mu, adam.nu):
    m = _leaf(moment, Q_PROJ)
    assert m.sharding == kernel.sharding
    _assert_split_over_model(m, tp=2)
  assert adam.count.sharding.is_fully_replicated and adam.count.sharding.mesh == mesh
  assert state["step"].sharding.is_fully_replicated
  per_device = sharding.bytes_per_device({"k": kernel})
  assert set(per_device) == {d.id for d in jax.devices()}
  assert all(n == kernel.nbytes // 2 for n in per_device.values())


def _copy_of(workdir, tmp_path):
  """A copy of the interrupted run's workdir: each test resumes its own."""
  shutil.copytree(workdir, tmp_path / "copy")
  return tmp_path / "copy"


def test_resume_on_the_same_mesh_is_bitwise_identical(runs, tmp_path):
  """Stopped at step 2 and resumed on the same dp=4,tp=2 mesh, the run ends with the params of
  the uninterrupted one bit for bit, through the same losses."""
  assert runs["first"].step == 2
  resumed = _train(_copy_of(runs["workdir"], tmp_path), mesh=_mesh("dp=4,tp=2"))
  assert resumed.resumed_from == 2 and resumed.step == STEPS
  _assert_tree_equal(resumed.params, runs["straight"].params)
  assert _losses(resumed.history).tolist() == _losses(runs["straight"].history)[2:].tolist()


def test_checkpoint_restores_onto_other_meshes(runs):
  """The state saved on 8 devices (dp=4,tp=2) restores on one device and on a 4-device mesh
  with identical values, every leaf laid out as the state it was restored into."""
  with Checkpointer(runs["workdir"]) as ckpt:
    on8 = ckpt.restore(_state_like(_mesh("dp=4,tp=2")))
    on1 = ckpt.restore(_state_like())
    mesh4 = _mesh("dp=2,tp=2", 4)
    on4 = ckpt.restore(_state_like(mesh4))
  assert int(on1["step"]) == int(on4["step"]) == 2
  _assert_tree_equal(on1, on8)
  _assert_tree_equal(on4, on8)
  _assert_tree_equal(on8["params"], runs["first"].params)
  assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(on1))
  like4 = _state_like(mesh4)
  for x, y in zip(jax.tree.leaves(on4), jax.tree.leaves(like4), strict=True):
    assert x.sharding == y.sharding
  kernel = _leaf(on4["params"], Q_PROJ)
  assert kernel.sharding.mesh == mesh4 and len(kernel.sharding.device_set) == 4
  _assert_split_over_model(kernel, tp=2)
  mu = _leaf(on4["opt_state"][1][0].mu, Q_PROJ)
  _assert_split_over_model(mu, tp=2)


def test_resume_on_another_mesh_continues_the_run(runs, tmp_path):
  """The dp=4,tp=2 run stopped at step 2, resumed on a 4-device dp=2,tp=2 mesh, ends where the
  uninterrupted run does (up to float rounding), on the new mesh."""
  mesh4 = _mesh("dp=2,tp=2", 4)
  resumed = _train(_copy_of(runs["workdir"], tmp_path), mesh=mesh4)
  assert resumed.resumed_from == 2 and resumed.step == STEPS
  _assert_tree_close(resumed.params, runs["straight"].params, rtol=1e-4, atol=1e-5)
  assert _leaf(resumed.params, Q_PROJ).sharding.mesh == mesh4


def test_loop_refuses_a_batch_dp_does_not_divide():
  def odd(start):
    for b in _batches(start):
      yield LMBatch(inputs=b.inputs[:6], targets=b.targets[:6])

  with pytest.raises(ValueError, match=r"batch_size 6 \(of inputs\) is not a multiple of the "
                                       r"data axis of the mesh \(dp=4,tp=2, dp=4\)"):
    _train(mesh=_mesh("dp=4,tp=2"), batches=odd)
  with pytest.raises(ValueError, match="param_shardings lay params out on a mesh"):
    loop.initial_state(decoder.init_params(CFG, 0), _tx(),
                       param_shardings=sharding.param_shardings(
                           CFG, decoder.abstract_params(CFG), _mesh("dp=4,tp=2")))

