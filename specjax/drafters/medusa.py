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

from specjax.config_utils import NonNegInt, PosInt, config
from specjax.drafters import io, learned, static_tree
from specjax.drafters.base import DraftContext, TargetView
from specjax.drafters.static_tree import HeadState, StaticTreeDrafter


@config
class MedusaConfig:
  hidden_size: PosInt  # E of the target
  num_heads: PosInt = 4  # K: head k predicts the token k + 1 after the last committed one
  dtype: str = "float32"
  num_layers: PosInt = 1  # applications of each head's (one, shared) residual block
  own_heads: bool = False  # each head its own LM head [E, Vd] (else the target's, restricted)
  draft_vocab_size: NonNegInt = 0  # Vd of the own heads (own_heads only)

  def __post_init__(self):
    if self.own_heads and self.draft_vocab_size < 1:
      raise ValueError("Medusa's own heads need draft_vocab_size >= 1")

  def with_dtype(self, dtype: str) -> MedusaConfig:
    return dataclasses.replace(self, dtype=dtype)


@config
class MedusaOptions(static_tree.StaticTreeOptions):
  """Medusa's training options: its heads (`num_heads`) and their depth."""

  num_layers: PosInt = 1  # applications of each head's residual block (MedusaConfig.num_layers)


class MedusaHeads(nnx.Module):

  def __init__(self, cfg: MedusaConfig, rngs: nnx.Rngs):
    e, k = cfg.hidden_size, cfg.num_heads
    dtype = jnp.dtype(cfg.dtype)
    self.num_layers = cfg.num_layers
    self.weight = nnx.Param(jnp.zeros((k, e, e), dtype))  # [K, E, E]
    self.bias = nnx.Param(jnp.zeros((k, e), dtype))
    if cfg.own_heads:  # the target's head is the starting point (MedusaFamily.init_params)
      self.lm_head = nnx.Param(jnp.zeros((k, e, cfg.draft_vocab_size), dtype))  # [K, E, Vd]

  def __call__(self, f: jax.Array) -> jax.Array:
    """f: [..., E] -> [..., K, E]: head k's block x + SiLU(W_k x + b_k), num_layers times."""
    w, b = self.weight[...], self.bias[...]
    h = f[..., None, :] + jax.nn.silu(jnp.einsum("...E,KEF->...KF", f, w) + b)
    for _ in range(self.num_layers - 1):
      h = h + jax.nn.silu(jnp.einsum("...KE,KEF->...KF", h, w) + b)
    return h

  def logits(self, h: jax.Array, head: jax.Array | None) -> jax.Array:
    """h: [..., S, E] of the first S heads -> float32[..., S, Vd], through each head's own LM
    head or `head` ([E, Vd], the target's over the draft vocabulary)."""
    if hasattr(self, "lm_head"):
      own = self.lm_head[...][:h.shape[-2]]
      return jnp.einsum("...SE,SEV->...SV", h, own, preferred_element_type=jnp.float32)
    return jnp.einsum("...SE,EV->...SV", h, head, preferred_element_type=jnp.float32)


@struct.dataclass
class Medusa(StaticTreeDrafter):
  # Each head's [E, E] block by columns (its bias with it); the residual re-joins them. Own LM
  # heads [K, E, Vd] over the vocabulary, as the target's.
  partition_rules = ((r"params/weight$", (None, None, "mlp")), (r"params/bias$", (None, "mlp")),
                     (r"params/lm_head$", (None, None, "vocab")))

  def draft(self, target: TargetView, state: HeadState, ctx: DraftContext):
    heads = learned.merge(MedusaHeads, self.net, self.params)
    h = heads(state.feature.astype(self.head_dtype))  # [B, K, E]
    recent = self.recent_vocab(target, ctx)
    logits = learned.with_recent(heads.logits(h, self.head), h, recent)
    if self.children.used(target.sampling) != "top_k":
      logp = learned.draft_logprobs(logits)  # [B, K, Vd (+ R)]

      def level_logp(d, parents, tokens):  # head d below every depth-(d - 1) parent
        return jnp.broadcast_to(logp[:, d - 1, None], (logp.shape[0], len(parents),
                                                       logp.shape[-1]))

      tokens, valid, draft = static_tree.sample_template(
          self.template, self.children, target.sampling, ctx.rng, level_logp, logp.shape[0])
      tree = self.template.tree(tokens, valid=valid, draft=draft)
      return self.with_targets(tree, recent), state, ctx.cache
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
  options_cls = MedusaOptions

  def make_config(self, target_cfg, *, draft_vocab_size: int, num_features: int,
                  options: MedusaOptions | None = None):
    del draft_vocab_size, num_features  # the heads read one feature and the target's head
    options = options or MedusaOptions()
    return MedusaConfig(target_cfg.hidden_size, options.num_heads, num_layers=options.num_layers)

  def init_params(self, net, target, d2t, seed: int):
    """Own LM heads start as the target's restricted to d2t (Medusa's initialisation)."""
    params = learned.init_params(MedusaHeads, net, seed)
    if net.own_heads:
      heads = learned.merge(MedusaHeads, net, params)
      head = learned.restricted_head(target.config, target.params, d2t).astype(net.dtype)
      heads.lm_head[...] = jnp.broadcast_to(head, heads.lm_head.shape)
      params = nnx.split(heads)[1]
    return params

  def depth_logits(self, net, params, x, num_steps, *, train=False):
    """Head s + 1 on the feature at t predicts the token at t + s + 2."""
    heads = learned.merge(MedusaHeads, net, params)
    h = heads(x.feats)  # [B, T, K, E]
    logits = jnp.moveaxis(heads.logits(h[:, :, :num_steps], x.head), 2, 0)  # [S, B, T, Vd]
    return logits, jnp.zeros((), jnp.float32)

  def shrink_vocab(self, net, params, size):
    net, params = super().shrink_vocab(net, params, size)
    if net.own_heads:
      params = learned.map_leaf(params, "lm_head", lambda k: k[..., :size])  # [K, E, Vd]
    return net, params

  def draft_head(self, net, target, d2t):
    """The target's LM head over the draft vocabulary; None with own LM heads."""
    if not net.own_heads:
      return super().draft_head(net, target, d2t)
    if net.draft_vocab_size != d2t.shape[0]:
      raise ValueError(f"Medusa's own LM heads cover {net.draft_vocab_size} draft ids, its d2t "
                       f"{d2t.shape[0]}")
    return None


FAMILY = io.register_family(MedusaFamily())
