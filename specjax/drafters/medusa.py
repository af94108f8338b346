"""Medusa (Cai et al. 2024): K residual heads on the target's last hidden state.

Head k reads the target's final normed hidden state f_t at the last committed position and
predicts the token k + 1 places after it (the target's own LM head predicts the next one, which
is `pending`): h_k = f_t + SiLU(W_k f_t + b_k), logits_k = h_k @ head, with `head` the target's
LM head over the draft vocabulary. W_k starts at zero, so an untrained head predicts what the
target's LM head does (Medusa's initialisation).

All K heads run in one batched matmul per round; the static tree ("choices", `TreeTemplate`)
takes the rank-r candidate of head d for a depth-d node whatever its parent, which is what makes
Medusa cheap and what limits it (its heads cannot see the tokens drafted before them; Hydra can).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.drafters import io, learned, static_tree
from specjax.drafters.base import DraftContext, TargetView
from specjax.drafters.static_tree import HeadState, StaticTreeDrafter


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  hidden_size: int  # E of the target
  num_heads: int = 4  # K: head k predicts the token k + 1 after the last committed one
  dtype: str = "float32"

  def with_dtype(self, dtype: str) -> MedusaConfig:
    return dataclasses.replace(self, dtype=dtype)


class MedusaHeads(nnx.Module):

  def __init__(self, cfg: MedusaConfig, rngs: nnx.Rngs):
    e, k = cfg.hidden_size, cfg.num_heads
    dtype = jnp.dtype(cfg.dtype)
    self.weight = nnx.Param(jnp.zeros((k, e, e), dtype))  # [K, E, E]
    self.bias = nnx.Param(jnp.zeros((k, e), dtype))

  def __call__(self, f: jax.Array) -> jax.Array:
    """f: [..., E] -> [..., K, E]."""
    z = jnp.einsum("...E,KEF->...KF", f, self.weight[...]) + self.bias[...]
    return f[..., None, :] + jax.nn.silu(z)


@struct.dataclass
class Medusa(StaticTreeDrafter):
  # Each head's [E, E] block by columns (its bias with it); the residual re-joins them.
  partition_rules = ((r"params/weight$", (None, None, "mlp")), (r"params/bias$", (None, "mlp")))

  def draft(self, target: TargetView, state: HeadState, ctx: DraftContext):
    heads = learned.merge(MedusaHeads, self.net, self.params)
    h = heads(state.feature.astype(self.head.dtype))  # [B, K, E]
    recent = self.recent_vocab(target, ctx)
    logits = learned.with_recent(
        jnp.einsum("BKE,EV->BKV", h, self.head, preferred_element_type=jnp.float32), h, recent)
    k = int(self.template.rank.max()) + 1
    _, ranked = jax.lax.top_k(logits, k)  # [B, K, k] draft ids, best first
    picked = ranked[:, self.template.depth - 1, self.template.rank]  # [B, N]
    return self.template.tree(self.to_target_ids(picked, recent)), state, ctx.cache


class MedusaFamily(static_tree.StaticTreeFamily):
  name = "medusa"
  description = "K residual heads on the last hidden state, static tree (Medusa-1)"
  module = MedusaHeads
  config_cls = MedusaConfig
  drafter_cls = Medusa

  def depth_logits(self, net, params, x, num_steps, *, train=False):
    """Head s + 1 on the feature at t predicts the token at t + s + 2."""
    h = learned.merge(MedusaHeads, net, params)(x.feats)  # [B, T, K, E]
    logits = jnp.einsum("BTKE,EV->KBTV", h[:, :, :num_steps], x.head,
                        preferred_element_type=jnp.float32)
    return logits, jnp.zeros((), jnp.float32)


FAMILY = io.register_family(MedusaFamily())
