"""A generic optax training loop with orbax checkpoints, exact resume and a progress bar.

Used by the target LM and drafter trainers: they supply a loss, initial params, a batch stream
that can restart at any step, and an evaluation function. Exact resume rests on three facts: the
state pytree (params, optimiser state, step, elapsed time) is saved bit for bit; the batch stream
for step k depends only on (seed, k); and the compiled step is the same program before and after.

On a device mesh (`specjax.sharding`: axes `data` and `model`) the same loop trains sharded:
params lie as their shardings say (tensor parallel by the partition rules; replicated when none
are given), the optimiser state's copies of the params (Adam's mu and nu) lie like the params and
its scalars (counts) are replicated, each batch is split over `data` on its leading dimension, and
the step is compiled with explicit in/out shardings, donating the state. Checkpoints hold the
global arrays, not a mesh: a run saved on one mesh restores onto any other (a resume on the same
mesh is bit-exact; on another it continues the same run up to float rounding, the reductions
being ordered differently).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, Sharding
from tqdm.auto import tqdm

from specjax import sharding
from specjax.config_utils import flatten, to_dict
from specjax.train.checkpoint import Checkpointer

# (params, batch) -> (loss, metrics). A batch is any pytree of arrays, in the trainers a
# `flax.struct` dataclass of typed fields (`pipeline.LMBatch`, the drafter trainer's batch).
LossFn = Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  total_steps: int
  log_every: int = 10
  eval_every: int = 250
  save_every: int = 250
  keep_checkpoints: int = 3
  tokens_per_step: int = 0  # for the progress bar's tokens/s


@dataclasses.dataclass
class TrainResult:
  params: Any
  step: int
  elapsed_seconds: float  # training wall time summed over every resumed run
  history: list[dict[str, float]]  # one record per log / eval event of *this* run
  resumed_from: int | None


class NonFiniteError(FloatingPointError):
  """Training reached a non-finite loss, gradient norm or parameters, and stopped.

  A FloatingPointError (an ArithmeticError), as JAX's own `jax_debug_nans` raises: the run's
  numerics failed, which no argument check could have caught; a ValueError would read as a bad
  config and be caught by the handlers of those. `train` raises it before any checkpoint with
  non-finite params is written and without returning, so the caller exports nothing.

  step: the first step (counted as checkpoints and log records count them: the step that
  completes `step` updates) whose loss or gradient norm was non-finite, or the step at which the
  params were found non-finite. what: what was non-finite ("loss", "gradient norm",
  "parameters"). resume_step: the step of the last good checkpoint, the one a rerun resumes from
  (None: no checkpoint, a rerun starts afresh). checkpoint_dir: where it lies (None: no workdir).
  """

  def __init__(self, message: str, *, step: int, what: tuple[str, ...],
               resume_step: int | None, checkpoint_dir: str | None):
    super().__init__(message)
    self.step = step
    self.what = what
    self.resume_step = resume_step
    self.checkpoint_dir = checkpoint_dir


RUN_CONFIG = "run_config.json"


# Fields of a trainer's config that cannot change the parameters it reaches. `mesh` is one: a
# checkpoint restores onto any mesh, and a run resumed on another continues the same optimisation
# (up to float rounding: on the same mesh a resume is bit-exact).
NOT_RUN_SETTINGS = ("log_every", "eval_every", "save_every", "workdir", "export_dir",
                    "export_dtype", "mesh")


def check_outputs(workdir: str, export_dir: str | None, overwrite_shipped: bool,
                  kind: str) -> None:
  """Before any work: a trainer's export (`export_dir`, default `<workdir>/export`, a `kind`
  folder: `files.export_kind`) may replace a shipped folder only with `overwrite_shipped`,
  never a folder of another kind, nor lie among the run's checkpoints; its workdir never lies
  in the assets."""
  from specjax import assets, files
  export = export_dir or os.path.join(workdir, "export")
  assets.check_writable(export, overwrite_shipped, "export_dir")
  assets.check_not_shipped(workdir, "workdir")
  files.check_export_over(export, kind, "export_dir")
  checkpoints = os.path.realpath(os.path.join(workdir, "checkpoints"))
  here = os.path.realpath(export)
  if here == os.path.realpath(workdir) or os.path.commonpath([here, checkpoints]) == checkpoints:
    raise ValueError(f"export_dir {export} would lie in the run's own workdir {workdir} or its "
                     "checkpoints: export beside them (the default is <workdir>/export)")


def check_run_config(workdir: str, cfg: Any, *,
                     recorded_as: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                     ) -> None:
  """Records the settings a run starts with (`cfg`, a trainer's config dataclass, less
  NOT_RUN_SETTINGS) in `workdir`, and refuses to resume a run that was started with other ones:
  its checkpoints would continue under another schedule or data, and the result would match
  neither run. `recorded_as`: the trainer's reading of settings recorded in an older form (a
  run started by an older version resumes), applied before the comparison."""
  settings = {k: v for k, v in to_dict(cfg).items() if k not in NOT_RUN_SETTINGS}
  path = os.path.join(workdir, RUN_CONFIG)
  if os.path.isfile(path):
    with open(path) as f:
      recorded = json.load(f)
    if recorded_as is not None and isinstance(recorded, dict):
      recorded = recorded_as(recorded)
    if set(recorded) != set(settings):  # another trainer's run (a target LM's, say)
      theirs = sorted(set(recorded) - set(settings))[:6]
      raise ValueError(f"{workdir} holds a run of another trainer: its settings have fields "
                       f"{theirs} that this run's config has not. Train in a fresh workdir")
    saved, current = flatten(recorded), flatten(settings)
    diff = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diff:
      detail = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in diff)
      raise ValueError(f"{workdir} holds a run started with other settings ({detail}). Resume "
                       "it with its own settings, or train in a fresh workdir")
    return
  from specjax import files  # atomic: a failed write never leaves a truncated run config
  files.check_output_dir(workdir, "workdir")
  files.write_json(path, settings, indent=1, sort_keys=True)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, state_shardings: Any = None,
                    batch_shardings: Any = None):
  """Returns a jitted `(state, guard, batch) -> (state, guard, metrics)` that donates the old
  state and guard.

  `guard` (`initial_guard`) records the first step whose loss or gradient norm was non-finite:
  a few scalar ops a step on device, read by the host only where the loop syncs anyway. It is
  not part of the state, so checkpoints hold what they always held.

  On a `mesh` the step is compiled with explicit shardings: the state in and out as
  `state_shardings` (its pytree), the batch as `batch_shardings` (a pytree prefix of a batch),
  the guard and metrics replicated; it is traced and run under the mesh, so mesh-aware model
  code (the Pallas attention's shard_map) sees it.
  """

  def step(state, guard, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    done = state["step"] + 1
    loss32 = metrics["loss"].astype(jnp.float32)
    norm32 = metrics["grad_norm"].astype(jnp.float32)
    first = (guard["step"] < 0) & ~(jnp.isfinite(loss32) & jnp.isfinite(norm32))
    guard = {"step": jnp.where(first, done, guard["step"]),
             "loss": jnp.where(first, loss32, guard["loss"]),
             "grad_norm": jnp.where(first, norm32, guard["grad_norm"])}
    return dict(state, params=params, opt_state=opt_state, step=done), guard, metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=(0, 1))
  rep = sharding.replicated(mesh)
  jitted = jax.jit(step, in_shardings=(state_shardings, rep, batch_shardings),
                   out_shardings=(state_shardings, rep, rep), donate_argnums=(0, 1))

  def on_mesh(state, guard, batch):
    with jax.set_mesh(mesh):
      return jitted(state, guard, batch)

  return on_mesh


def _key_names(path: tuple) -> tuple[str, ...]:
  return tuple(sharding.path_str((k,)) for k in path)


def opt_state_shardings(tx: optax.GradientTransformation, params: Any, param_shardings: Any,
                        mesh: Mesh) -> Any:
  """The sharding of each leaf of `tx.init(params)`: a leaf that mirrors a parameter (its key
  path ends with the parameter's and its shape is the parameter's, as Adam's mu and nu do, under
  chains, masks and multi_transform alike) lies like that parameter; anything else (step counts,
  a schedule's state) is replicated."""
  by_path: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}

  def record(path, p, s):
    by_path[_key_names(path)] = (tuple(p.shape), s)

  jax.tree_util.tree_map_with_path(record, params, param_shardings)
  longest = max((len(k) for k in by_path), default=0)
  rep = sharding.replicated(mesh)

  def one(path, leaf):
    names = _key_names(path)
    for n in range(min(longest, len(names)), 0, -1):
      shape, s = by_path.get(names[-n:], (None, None))
      if s is not None and shape == tuple(leaf.shape):
        return s
    return rep

  return jax.tree_util.tree_map_with_path(one, jax.eval_shape(tx.init, params))


def initial_state(params: Any, tx: optax.GradientTransformation, *, mesh: Mesh | None = None,
                  param_shardings: Any = None) -> tuple[dict[str, Any], Any]:
  """(the training state `{"params", "opt_state", "step", "elapsed"}` at step 0, its shardings).

  Without a mesh the state lives where `params` do and its shardings are None. On a `mesh` the
  params are placed by `param_shardings` (default: replicated), the optimiser state is built
  directly on `opt_state_shardings` (no device ever holds a full copy of a sharded leaf), and
  the scalars are replicated. The same state on another mesh is what a checkpoint restores onto.
  """
  elapsed_dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  if mesh is None:
    if param_shardings is not None:
      raise ValueError("param_shardings lay params out on a mesh: pass the mesh too")
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
             "elapsed": jnp.zeros((), elapsed_dtype)}
    return state, None
  rep = sharding.replicated(mesh)
  if param_shardings is None:
    param_shardings = jax.tree.map(lambda _: rep, params)
  params = sharding.place(params, param_shardings)
  opt_shardings = opt_state_shardings(tx, params, param_shardings, mesh)
  state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": rep,
                     "elapsed": rep}
  state = {"params": params, "opt_state": jax.jit(tx.init, out_shardings=opt_shardings)(params),
           # host values: placing them is valid onto devices of other processes too
           "step": jax.device_put(np.zeros((), np.int32), rep),
           "elapsed": jax.device_put(np.zeros((), elapsed_dtype), rep)}
  return state, state_shardings


def initial_guard(mesh: Mesh | None = None) -> dict[str, jax.Array]:
  """The train step's record of its first non-finite step: `step` -1 (none yet), and the loss
  and gradient norm of that step once there is one; replicated on a `mesh`."""
  host = {"step": np.full((), -1, np.int32), "loss": np.zeros((), np.float32),
          "grad_norm": np.zeros((), np.float32)}
  if mesh is None:
    return jax.tree.map(jnp.asarray, host)
  return jax.device_put(host, sharding.replicated(mesh))


def _finite_check(mesh: Mesh | None) -> Callable[[Any], bool]:
  """`params -> bool`: whether every float leaf is finite (one jitted reduction, whatever the
  params' layout; on a mesh its answer is replicated, so every process reads it)."""

  def finite(params):
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(params)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)

  if mesh is None:
    jitted = jax.jit(finite)
    return lambda params: bool(jitted(params))
  jitted = jax.jit(finite, out_shardings=sharding.replicated(mesh))

  def on_mesh(params):
    with jax.set_mesh(mesh):
      return bool(jitted(params))

  return on_mesh


def _nonfinite_error(problem: str, step: int, what: tuple[str, ...], total: int,
                     resume_step: int | None, ckpt: Checkpointer | None,
                     detail: str = "") -> NonFiniteError:
  """The NonFiniteError for `problem` ("the loss (nan) was non-finite") at `step`, saying which
  checkpoint a rerun resumes from. detail: follows the step, e.g. " (finite at step 10)"."""
  if resume_step is not None:
    resume = (f"the last good checkpoint is step {resume_step} in {ckpt.directory}: a rerun with "
              "the same settings resumes from it (a run with other settings, e.g. a lower "
              "learning rate, needs a fresh workdir)")
  elif ckpt is not None:
    resume = f"no checkpoint was saved before it in {ckpt.directory}, so a rerun starts afresh"
  else:
    resume = "nothing was saved (no workdir)"
  return NonFiniteError(f"training stopped: {problem} at step {step} of {total}{detail}, so "
                        f"nothing is exported; {resume}", step=step, what=what,
                        resume_step=resume_step, checkpoint_dir=ckpt.directory if ckpt else None)


def _guard_error(guard: Any, total: int, resume_step: int | None,
                 ckpt: Checkpointer | None) -> NonFiniteError | None:
  """The error for a guard (read on the host) that recorded a non-finite step, else None."""
  step = int(guard["step"])
  if step < 0:
    return None
  bad = [(name, float(guard[key])) for name, key in (("loss", "loss"),
                                                      ("gradient norm", "grad_norm"))
         if not np.isfinite(guard[key])]
  problem = " and ".join(f"the {name} ({value})" for name, value in bad)
  problem += " was non-finite" if len(bad) == 1 else " were non-finite"
  return _nonfinite_error(problem, step, tuple(name for name, _ in bad), total, resume_step,
                          ckpt)


def check_batch_size(name: str, size: int, mesh: Mesh | None) -> None:
  """ValueError unless `size` rows split evenly over the mesh's data axis."""
  dp = sharding.data_size(mesh)
  if size % dp:
    raise ValueError(f"{name} {size} is not a multiple of the data axis of the mesh "
                     f"({sharding.mesh_spec(mesh)}, dp={dp}): every data shard takes the same "
                     f"number of rows, so use a {name} divisible by {dp} or a smaller dp")


def _check_batch(batch: Any, batch_shardings: Any, mesh: Mesh) -> None:
  """Every dimension a batch leaf splits over `data` divides by dp (the leading one: the batch
  size), checked before the transfer so the error names the problem."""
  dp = sharding.data_size(mesh)

  def check(outer, s, sub):
    if not isinstance(s, NamedSharding):
      return
    for inner, leaf in jax.tree_util.tree_leaves_with_path(sub):
      path = tuple(outer) + tuple(inner)
      for dim, axes in enumerate(s.spec):
        names = axes if isinstance(axes, tuple) else (axes,)
        if sharding.DATA in names and dim < np.ndim(leaf) and np.shape(leaf)[dim] % dp:
          what = "batch_size" if dim == 0 else f"dimension {dim}"
          where = sharding.path_str(path) or "the batch"
          raise ValueError(f"{what} {np.shape(leaf)[dim]} (of {where}) is not a multiple of the "
                           f"data axis of the mesh ({sharding.mesh_spec(mesh)}, dp={dp}): every "
                           "data shard takes the same number of rows")

  jax.tree_util.tree_map_with_path(check, batch_shardings, batch,
                                   is_leaf=lambda x: x is None or isinstance(x, Sharding))


def train(loss_fn: LossFn, params: Any, tx: optax.GradientTransformation,
          batches: Callable[[int], Iterator[Any]], cfg: LoopConfig, *,
          workdir: str | None = None, evaluate: Callable[[Any], dict[str, float]] | None = None,
          stop_after: int | None = None, progress: bool = True, desc: str = "train",
          mesh: Mesh | None = None, param_shardings: Any = None,
          batch_shardings: Any = None) -> TrainResult:
  """Trains to `cfg.total_steps`, resuming from the latest checkpoint in `workdir` if any.

  batches(start_step) must yield the batches for steps start_step, start_step + 1, ...
  stop_after: stop (with a checkpoint) after this many steps of *this* run — used to simulate an
  interruption in tests; a killed process resumes the same way from its last periodic save.
  mesh: train on this device mesh (None: one device, as the params lie). param_shardings: a
  NamedSharding per param leaf (default on a mesh: replicated, pure data parallelism);
  batch_shardings: a pytree prefix of a batch (default: every leaf split over `data` on its
  leading dimension, which must then be a multiple of dp). The checkpoint of `workdir` restores
  onto these shardings whatever mesh saved it. The returned params lie on the mesh.

  A non-finite loss, gradient norm or parameters stop the run with a `NonFiniteError` naming
  the first bad step: the step records its first non-finite step on device, read wherever the
  loop syncs anyway (log, eval, save, end), and the params are checked before each checkpoint
  save and before returning. No checkpoint with non-finite params is written, so the last good
  one stays for a rerun to resume from. A resumed run says where it resumed (`progress`) and
  returns it as `resumed_from`.
  """
  if mesh is not None:
    mesh = sharding.make_mesh(mesh)
    if batch_shardings is None:
      batch_shardings = sharding.batch_sharding(mesh)
  elif batch_shardings is not None:
    raise ValueError("batch_shardings lay batches out on a mesh: pass the mesh too")
  state, state_shardings = initial_state(params, tx, mesh=mesh, param_shardings=param_shardings)
  ckpt = Checkpointer(workdir, max_to_keep=cfg.keep_checkpoints) if workdir else None
  bar = None
  try:
    resumed_from = ckpt.latest_step() if ckpt else None
    if resumed_from is not None:
      state = ckpt.restore(state)
    start = int(state["step"])
    finite = _finite_check(mesh)
    if not finite(state["params"]):
      if resumed_from is not None:  # a checkpoint written before saves were checked
        raise NonFiniteError(
            f"the checkpoint of step {start} in {ckpt.directory} holds non-finite parameters: "
            "remove it to resume from an earlier one (or train afresh in a new workdir)",
            step=start, what=("parameters",), resume_step=None, checkpoint_dir=ckpt.directory)
      raise _nonfinite_error("the initial parameters were non-finite", start, ("parameters",),
                             cfg.total_steps, None, ckpt)
    last_good, params_checked = resumed_from, start  # the checkpoint a rerun resumes from

    def check_guard() -> None:
      error = _guard_error(jax.device_get(guard), cfg.total_steps, last_good, ckpt)
      if error is not None:
        raise error

    def check_params(done: int) -> None:
      if not finite(state["params"]):
        raise _nonfinite_error("the parameters were non-finite", done, ("parameters",),
                               cfg.total_steps, last_good, ckpt,
                               f" (finite at step {params_checked})")

    train_step = make_train_step(loss_fn, tx, mesh=mesh, state_shardings=state_shardings,
                                 batch_shardings=batch_shardings)
    guard = initial_guard(mesh)
    history: list[dict[str, float]] = []
    end = cfg.total_steps if stop_after is None else min(cfg.total_steps, start + stop_after)
    bar = tqdm(total=cfg.total_steps, initial=start, desc=desc, disable=not progress,
               dynamic_ncols=True)
    if progress and resumed_from is not None:
      bar.write(f"resuming from step {start} of {cfg.total_steps} "
                f"(checkpoint in {ckpt.directory})")
    elapsed = float(state["elapsed"])
    t_mark = t_log = time.perf_counter()  # t_mark: elapsed-time accounting; t_log: throughput
    step_log = start
    stream = batches(start)
    if progress and start < end:
      bar.write("compiling the train step")  # the first step's minute is not a hang
    for step in range(start, end):
      batch = next(stream)
      if mesh is not None:
        _check_batch(batch, batch_shardings, mesh)
        batch = jax.device_put(batch, batch_shardings)
      state, guard, metrics = train_step(state, guard, batch)
      done = step + 1
      if done % cfg.log_every == 0 or done == end:
        host = jax.device_get(metrics)  # blocks: timings below are honest
        now = time.perf_counter()
        check_guard()
        tok_s = cfg.tokens_per_step * (done - step_log) / max(now - t_log, 1e-9)
        t_log, step_log = now, done
        loss = float(host["loss"])
        record = {"step": done, "loss": loss, "grad_norm": float(host["grad_norm"]),
                  "tokens_per_second": tok_s}
        record.update({k: float(v) for k, v in host.items() if k not in record})
        history.append(record)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
      if evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.total_steps):
        jax.block_until_ready(state)
        check_guard()
        t_eval = time.perf_counter()
        elapsed += t_eval - t_mark
        ev = evaluate(state["params"])
        history.append({"step": done, **{f"eval/{k}": v for k, v in ev.items()}})
        bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
        t_mark = time.perf_counter()  # evaluation time is not training time
        t_log += t_mark - t_eval
      bar.update(1)
      if ckpt and (done % cfg.save_every == 0 or done == end):
        jax.block_until_ready(state)
        check_guard()
        check_params(done)  # a checkpoint never holds non-finite params
        params_checked = done
        now = time.perf_counter()
        elapsed, t_mark = elapsed + now - t_mark, now
        if mesh is None:
          state["elapsed"] = jnp.asarray(elapsed, state["elapsed"].dtype)
        else:
          state["elapsed"] = jax.device_put(np.asarray(elapsed, state["elapsed"].dtype),
                                            state_shardings["elapsed"])
        ckpt.save(done, state, force=True)
        last_good = done
    bar.close()
    jax.block_until_ready(state)
    elapsed += time.perf_counter() - t_mark
    check_guard()
    if params_checked != end:
      check_params(max(start, end))
  finally:  # in-flight saves finish and orbax's threads stop, on errors too
    if bar is not None:
      bar.close()
    if ckpt:
      ckpt.close()
  return TrainResult(state["params"], int(state["step"]), elapsed, history, resumed_from)
