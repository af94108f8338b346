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

LossFn = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


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


RUN_CONFIG = "run_config.json"


# Fields of a trainer's config that cannot change the parameters it reaches. `mesh` is one: a
# checkpoint restores onto any mesh, and a run resumed on another continues the same optimisation
# (up to float rounding: on the same mesh a resume is bit-exact).
NOT_RUN_SETTINGS = ("log_every", "eval_every", "save_every", "workdir", "export_dir",
                    "export_dtype", "mesh")


def check_run_config(workdir: str, cfg: Any) -> None:
  """Records the settings a run starts with (`cfg`, a trainer's config dataclass, less
  NOT_RUN_SETTINGS) in `workdir`, and refuses to resume a run that was started with other ones:
  its checkpoints would continue under another schedule or data, and the result would match
  neither run."""
  settings = {k: v for k, v in to_dict(cfg).items() if k not in NOT_RUN_SETTINGS}
  path = os.path.join(workdir, RUN_CONFIG)
  if os.path.isfile(path):
    with open(path) as f:
      saved, current = flatten(json.load(f)), flatten(settings)
    diff = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diff:
      detail = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in diff)
      raise ValueError(f"{workdir} holds a run started with other settings ({detail}). Resume "
                       "it with its own settings, or train in a fresh workdir")
    return
  os.makedirs(workdir, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(settings, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, state_shardings: Any = None,
                    batch_shardings: Any = None):
  """Returns a jitted `(state, batch) -> (state, metrics)` that donates the old state.

  On a `mesh` the step is compiled with explicit shardings: the state in and out as
  `state_shardings` (its pytree), the batch as `batch_shardings` (a pytree prefix of a batch),
  the metrics replicated; it is traced and run under the mesh, so mesh-aware model code (the
  Pallas attention's shard_map) sees it.
  """

  def step(state, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return dict(state, params=params, opt_state=opt_state, step=state["step"] + 1), metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=0)
  jitted = jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)

  def on_mesh(state, batch):
    with jax.set_mesh(mesh):
      return jitted(state, batch)

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
          batches: Callable[[int], Iterator[dict[str, np.ndarray]]], cfg: LoopConfig, *,
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
  """
  if mesh is not None:
    mesh = sharding.make_mesh(mesh)
    if batch_shardings is None:
      batch_shardings = sharding.batch_sharding(mesh)
  elif batch_shardings is not None:
    raise ValueError("batch_shardings lay batches out on a mesh: pass the mesh too")
  state, state_shardings = initial_state(params, tx, mesh=mesh, param_shardings=param_shardings)
  ckpt = Checkpointer(workdir, max_to_keep=cfg.keep_checkpoints) if workdir else None
  try:
    resumed_from = ckpt.latest_step() if ckpt else None
    if resumed_from is not None:
      state = ckpt.restore(state)
    start = int(state["step"])
    train_step = make_train_step(loss_fn, tx, mesh=mesh, state_shardings=state_shardings,
                                 batch_shardings=batch_shardings)
    history: list[dict[str, float]] = []
    end = cfg.total_steps if stop_after is None else min(cfg.total_steps, start + stop_after)
    bar = tqdm(total=cfg.total_steps, initial=start, desc=desc, disable=not progress,
               dynamic_ncols=True)
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
      state, metrics = train_step(state, batch)
      done = step + 1
      if done % cfg.log_every == 0 or done == end:
        loss = float(metrics["loss"])  # blocks: timings below are honest
        now = time.perf_counter()
        tok_s = cfg.tokens_per_step * (done - step_log) / max(now - t_log, 1e-9)
        t_log, step_log = now, done
        record = {"step": done, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                  "tokens_per_second": tok_s}
        record.update({k: float(v) for k, v in metrics.items() if k not in record})
        history.append(record)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
      if evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.total_steps):
        jax.block_until_ready(state)
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
        now = time.perf_counter()
        elapsed, t_mark = elapsed + now - t_mark, now
        if mesh is None:
          state["elapsed"] = jnp.asarray(elapsed, state["elapsed"].dtype)
        else:
          state["elapsed"] = jax.device_put(np.asarray(elapsed, state["elapsed"].dtype),
                                            state_shardings["elapsed"])
        ckpt.save(done, state, force=True)
    bar.close()
    jax.block_until_ready(state)
    elapsed += time.perf_counter() - t_mark
  finally:  # in-flight saves finish and orbax's threads stop, on errors too
    if ckpt:
      ckpt.close()
  return TrainResult(state["params"], int(state["step"]), elapsed, history, resumed_from)
