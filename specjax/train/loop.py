"""A generic optax training loop with orbax checkpoints, exact resume and a progress bar.

Used by the target LM and drafter trainers: they supply a loss, initial params, a batch stream
that can restart at any step, and an evaluation function. Exact resume rests on three facts: the
state pytree (params, optimiser state, step, elapsed time) is saved bit for bit; the batch stream
for step k depends only on (seed, k); and the compiled step is the same program before and after.
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
from tqdm.auto import tqdm

from specjax.config_utils import to_dict
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


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


# Fields of a trainer's config that cannot change the parameters it reaches.
NOT_RUN_SETTINGS = ("log_every", "eval_every", "save_every", "workdir", "export_dir",
                    "export_dtype")


def check_run_config(workdir: str, cfg: Any) -> None:
  """Records the settings a run starts with (`cfg`, a trainer's config dataclass, less
  NOT_RUN_SETTINGS) in `workdir`, and refuses to resume a run that was started with other ones:
  its checkpoints would continue under another schedule or data, and the result would match
  neither run."""
  settings = {k: v for k, v in to_dict(cfg).items() if k not in NOT_RUN_SETTINGS}
  path = os.path.join(workdir, RUN_CONFIG)
  if os.path.isfile(path):
    with open(path) as f:
      saved, current = _flat(json.load(f)), _flat(settings)
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


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation):
  """Returns a jitted `(state, batch) -> (state, metrics)` that donates the old state."""

  def step(state, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return dict(state, params=params, opt_state=opt_state, step=state["step"] + 1), metrics

  return jax.jit(step, donate_argnums=0)


def train(loss_fn: LossFn, params: Any, tx: optax.GradientTransformation,
          batches: Callable[[int], Iterator[dict[str, np.ndarray]]], cfg: LoopConfig, *,
          workdir: str | None = None, evaluate: Callable[[Any], dict[str, float]] | None = None,
          stop_after: int | None = None, progress: bool = True,
          desc: str = "train") -> TrainResult:
  """Trains to `cfg.total_steps`, resuming from the latest checkpoint in `workdir` if any.

  batches(start_step) must yield the batches for steps start_step, start_step + 1, ...
  stop_after: stop (with a checkpoint) after this many steps of *this* run — used to simulate an
  interruption in tests; a killed process resumes the same way from its last periodic save.
  """
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "elapsed": jnp.zeros((), jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)}
  ckpt = Checkpointer(workdir, max_to_keep=cfg.keep_checkpoints) if workdir else None
  try:
    resumed_from = ckpt.latest_step() if ckpt else None
    if resumed_from is not None:
      state = ckpt.restore(state)
    start = int(state["step"])
    train_step = make_train_step(loss_fn, tx)
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
      state, metrics = train_step(state, next(stream))
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
        state["elapsed"] = jnp.asarray(elapsed, state["elapsed"].dtype)
        ckpt.save(done, state, force=True)
    bar.close()
    jax.block_until_ready(state)
    elapsed += time.perf_counter() - t_mark
  finally:  # in-flight saves finish and orbax's threads stop, on errors too
    if ckpt:
      ckpt.close()
  return TrainResult(state["params"], int(state["step"]), elapsed, history, resumed_from)
