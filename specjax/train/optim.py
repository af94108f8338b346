"""Optimiser: AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import jax
import optax

from specjax.config_utils import (
  Fraction,
  Interval,
  NonNegFloat,
  NonNegInt,
  PosFloat,
  PosInt,
  config,
)

# Adam's moment decays: in [0, 1).
Decay = Annotated[float, Interval(ge=0, lt=1)]


@config
class OptimConfig:
  learning_rate: PosFloat = 3e-3
  warmup_steps: NonNegInt = 200
  total_steps: PosInt = 3000
  final_lr_ratio: Fraction = 0.1  # cosine decays to learning_rate * final_lr_ratio
  weight_decay: NonNegFloat = 0.1
  clip_norm: PosFloat = 1.0
  b1: Decay = 0.9
  b2: Decay = 0.95

  def __post_init__(self):
    if self.warmup_steps >= self.total_steps:
      raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < total_steps "
                       f"({self.total_steps})")


def schedule(cfg: OptimConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.total_steps, end_value=cfg.learning_rate * cfg.final_lr_ratio)


def _decay_mask(params):
  # Decay matrices only: norms' gains and biases (rank 1) are left alone, as in GPT-style recipes.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, frozen: Callable[[Any], Any] | None = None
                   ) -> optax.GradientTransformation:
  """AdamW after clipping; `frozen(params)` -> a bool per leaf keeps those leaves fixed.

  Frozen leaves get no update at all (no weight decay either) and do not count in the clipped
  gradient norm: they are split off before the chain sees the gradients.
  """
  tx = optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=_decay_mask),
  )
  if frozen is None:
    return tx
  return optax.multi_transform(
      {"train": tx, "frozen": optax.set_to_zero()},
      lambda params: jax.tree.map(lambda f: "frozen" if f else "train", frozen(params)))
