"""The loop stops on a non-finite loss, gradient norm or parameters, and says where it resumed.

A toy least-squares problem (a 4-vector fitted to a target) whose batch can poison the loss at a
chosen step: its steps take microseconds, so a run is its compile time. The trainers' version
(a huge learning rate on the tiny LM) is in test_train_target.py.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax import cli
from specjax.train import loop
from specjax.train.checkpoint import Checkpointer

TOTAL = 12
CFG = loop.LoopConfig(total_steps=TOTAL, log_every=3, save_every=2, eval_every=100)


def _params():
  return {"w": jnp.zeros(4, jnp.float32), "unused": jnp.ones(2, jnp.float32)}


def _loss(params, batch):
  """Finite everywhere, save where the batch says: `bias` nan poisons the loss alone (its
  gradient stays finite), `scale` nan the loss and the gradient both. `unused` is not read."""
  err = (params["w"] - batch["x"]) * batch["scale"]
  return jnp.sum(err * err) + batch["bias"], {}


def _batches(poison: dict[int, str] | None = None):
  """`start -> iterator`; poison: {step (1-based, as the loop counts): "bias" or "scale"}."""

  def iterate(start: int):
    for i in range(start, 10**6):
      bad = (poison or {}).get(i + 1)
      yield {"x": np.arange(4, dtype=np.float32) + 0.01 * i,
             "scale": np.float32(np.nan if bad == "scale" else 1.0),
             "bias": np.float32(np.nan if bad == "bias" else 0.0)}

  return iterate


def _tx():
  return optax.sgd(0.1)


def _inf_at(step: int) -> optax.GradientTransformation:
  """Writes +inf into `unused` at update `step` (1-based): params no loss reads go non-finite,
  which only the params check can see."""

  def init(params):
    return {"count": jnp.zeros((), jnp.int32)}

  def update(updates, state, params=None):
    hit = state["count"] + 1 == step
    updates = dict(updates, unused=jnp.where(hit, jnp.inf, updates["unused"]))
    return updates, {"count": state["count"] + 1}

  return optax.chain(optax.sgd(0.1), optax.GradientTransformation(init, update))


def _assert_finite(tree):
  for leaf in jax.tree.leaves(tree):
    assert np.isfinite(np.asarray(leaf)).all()


def _latest(workdir, tx):
  with Checkpointer(workdir) as ckpt:
    step = ckpt.latest_step()
    state = loop.initial_state(_params(), tx)[0]
    return step, ckpt.restore(state)


@pytest.mark.parametrize("poison, what", [("bias", ("loss",)),
                                          ("scale", ("loss", "gradient norm"))])
def test_non_finite_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path, poison,
                                                                              what):
  """A loss (and gradient) that goes nan at step 7 stops the run at the next sync point (the
  save of step 8) with an error naming step 7; checkpoints 2, 4 and 6 stay, 8 is never written,
  and a rerun with the fixed loss resumes from 6 and ends where a clean run ends, bit for bit."""
  workdir = os.fspath(tmp_path / "ckpt")
  with pytest.raises(loop.NonFiniteError) as info:
    loop.train(_loss, _params(), _tx(), _batches({7: poison}), CFG, workdir=workdir,
               progress=False)
  err = info.value
  assert isinstance(err, FloatingPointError)
  assert (err.step, err.what, err.resume_step) == (7, what, 6)
  assert err.checkpoint_dir == os.path.abspath(workdir)
  message = str(err)
  assert f"at step 7 of {TOTAL}" in message and "nothing is exported" in message
  assert "the loss (nan)" in message
  assert ("the gradient norm (nan)" in message) == ("gradient norm" in what)
  assert f"the last good checkpoint is step 6 in {os.path.abspath(workdir)}" in message
  step, state = _latest(workdir, _tx())
  assert step == 6 and int(state["step"]) == 6
  _assert_finite(state["params"])

  resumed = loop.train(_loss, _params(), _tx(), _batches(), CFG, workdir=workdir, progress=False)
  clean = loop.train(_loss, _params(), _tx(), _batches(), CFG, progress=False)
  assert resumed.resumed_from == 6 and resumed.step == TOTAL
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(clean.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_first_bad_step_is_named_not_the_step_that_noticed_it():
  """Without a workdir the loop syncs only at log steps (3, 6, 9, 12): a nan at step 4 is named
  as step 4 when step 6 reads it, and a later bad step does not overwrite it."""
  with pytest.raises(loop.NonFiniteError, match=r"the loss \(nan\) was non-finite at step 4 of "
                     r"12, so nothing is exported; nothing was saved \(no workdir\)") as info:
    loop.train(_loss, _params(), _tx(), _batches({4: "bias", 5: "scale"}), CFG, progress=False)
  assert info.value.resume_step is None and info.value.checkpoint_dir is None


def test_non_finite_params_are_never_checkpointed(tmp_path):
  """An update that writes inf into params no loss reads (so loss and gradient stay finite) is
  caught by the params check before the next save: checkpoint 4 is the last, and finite."""
  workdir = os.fspath(tmp_path / "ckpt")
  cfg = loop.LoopConfig(total_steps=TOTAL, log_every=1, save_every=4)
  with pytest.raises(loop.NonFiniteError, match=r"the parameters were non-finite at step 8 of "
                     r"12 \(finite at step 4\).*last good checkpoint is step 4") as info:
    loop.train(_loss, _params(), _inf_at(6), _batches(), cfg, workdir=workdir, progress=False)
  assert (info.value.step, info.value.what, info.value.resume_step) == (8, ("parameters",), 4)
  step, state = _latest(workdir, _inf_at(6))
  assert step == 4
  _assert_finite(state["params"])
  # Without a workdir, the check before returning catches them.
  with pytest.raises(loop.NonFiniteError, match=r"parameters were non-finite at step 12 of 12 "
                     r"\(finite at step 0\)"):
    loop.train(_loss, _params(), _inf_at(6), _batches(), cfg, progress=False)


def test_non_finite_initial_params_are_refused():
  params = dict(_params(), unused=jnp.asarray([1.0, np.nan], jnp.float32))
  with pytest.raises(loop.NonFiniteError, match="the initial parameters were non-finite at step "
                     "0 of 12"):
    loop.train(_loss, params, _tx(), _batches(), CFG, progress=False)


def test_a_resumed_run_says_where_it_resumed(tmp_path, capsys):
  workdir = os.fspath(tmp_path / "ckpt")
  first = loop.train(_loss, _params(), _tx(), _batches(), CFG, workdir=workdir, stop_after=5,
                     progress=True)
  assert first.resumed_from is None and first.step == 5
  assert "resuming" not in capsys.readouterr().out
  second = loop.train(_loss, _params(), _tx(), _batches(), CFG, workdir=workdir, progress=True)
  assert second.resumed_from == 5 and second.step == TOTAL
  out = capsys.readouterr().out
  line = f"resuming from step 5 of {TOTAL} (checkpoint in {os.path.abspath(workdir)})"
  assert out.count(line) == 1
  # Quiet runs say nothing; the result still carries it.
  third = loop.train(_loss, _params(), _tx(), _batches(), CFG, workdir=workdir, progress=False)
  assert third.resumed_from == TOTAL and "resuming" not in capsys.readouterr().out


def test_cli_prints_a_non_finite_run_as_one_line_and_exits_1(capsys):
  error = loop.NonFiniteError("training stopped: the loss (nan) was non-finite at step 7 of\n"
                              "12, so nothing is exported", step=7, what=("loss",),
                              resume_step=None, checkpoint_dir=None)

  def train(cfg, stop_after=None, overwrite_shipped=False):
    raise error

  with pytest.raises(SystemExit) as info:
    cli.train_main("t", train, [], argv=["--config", "configs/target_stdlib.py"])
  assert info.value.code == 1
  err = capsys.readouterr().err
  assert err == ("error: training stopped: the loss (nan) was non-finite at step 7 of 12, so "
                 "nothing is exported\n")


def test_on_a_mesh_the_guard_and_the_params_check_work_alike(tmp_path):
  """The same stops on a dp=2,tp=2 mesh: the guard lies replicated beside the sharded state."""
  from specjax import sharding
  mesh = sharding.make_mesh("dp=2,tp=2", devices=jax.devices()[:4])
  rep = sharding.replicated(mesh)
  kw = {"mesh": mesh, "batch_shardings": rep, "progress": False}
  with pytest.raises(loop.NonFiniteError, match=r"gradient norm \(nan\) were non-finite at step "
                     r"7 of 12.*last good checkpoint is step 6"):
    loop.train(_loss, _params(), _tx(), _batches({7: "scale"}), CFG,
               workdir=os.fspath(tmp_path / "a"), **kw)
  cfg = loop.LoopConfig(total_steps=TOTAL, log_every=1, save_every=4)
  with pytest.raises(loop.NonFiniteError, match=r"parameters were non-finite at step 8 of 12"):
    loop.train(_loss, _params(), _inf_at(6), _batches(), cfg, workdir=os.fspath(tmp_path / "b"),
               **kw)
