"""Hydra (Ankner et al. 2024): Medusa heads made sequentially dependent on the drafted tokens.

Head d reads the target's hidden state f_t at the last committed position *and* the embeddings
of the tokens between it and the token it predicts: pending, then the d - 1 tokens drafted above
the node in the tree (each tree path conditions its own children). Head d is a residual MLP

  z = f_t + W_d [f_t, e(x_{t+1}), ..., e(x_{t+d})],   h = z + SiLU(U_d z + c_d),

followed by the target's LM head over the draft vocabulary, with W_d and U_d zero at
initialisation (an untrained head predicts what the target's LM head does, as Medusa's). The
static tree is expanded level by level: head d runs once on every depth-(d - 1) node that has
children, a batched matmul per level.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax import trees
from specjax.config_utils import PosInt, config
from specjax.drafters import io, learned, static_tree
from specjax.drafters.base import DraftContext, TargetView
from specjax.drafters.static_tree import HeadState, StaticTreeDrafter


@config
class HydraConfig:
  hidden_size: PosInt
  num_heads: PosInt = 4
  dtype: str = "float32"

  def with_dtype(self, dtype: str) -> HydraConfig:
    return dataclasses.replace(self, dtype=dtype)


@config
class HydraOptions(static_tree.StaticTreeOptions):
  """Hydra's training options: its heads (`num_heads`)."""


class HydraHead(nnx.Module):

  def __init__(self, e: int, depth: int, dtype, rngs: nnx.Rngs):
    self.w_in = nnx.Param(jnp.zeros(((depth + 1) * e, e), dtype))
    self.w_res = nnx.Param(jnp.zeros((e, e), dtype))
    self.b_res = nnx.Param(jnp.zeros((e,), dtype))

  def __call__(self, f: jax.Array, embs: jax.Array) -> jax.Array:
    """f: [..., E]; embs: [..., d, E] the tokens after f's position -> [..., E]."""
    x = jnp.concatenate([f, embs.reshape(embs.shape[:-2] + (-1,))], axis=-1)
    z = f + x @ self.w_in[...]
    return z + jax.nn.silu(z @ self.w_res[...] + self.b_res[...])


class HydraHeads(nnx.Module):

  def __init__(self, cfg: HydraConfig, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.heads = nnx.List([HydraHead(cfg.hidden_size, d, dtype, rngs)
                           for d in range(1, cfg.num_heads + 1)])


def _ancestors(template: trees.TreeTemplate, node: int) -> list[int]:
  path = []
  while node >= 0:
    path.append(node)
    node = int(template.parent[node])
  return path[::-1]


@struct.dataclass
class Hydra(StaticTreeDrafter):
  # Megatron pairs per head: w_in by columns, w_res by rows (one all-reduce per head).
  partition_rules = ((r"w_in$", (None, "mlp")), (r"w_res$", ("mlp", None)))

  def draft(self, target: TargetView, state: HeadState, ctx: DraftContext):
    heads = learned.merge(HydraHeads, self.net, self.params).heads
    b = ctx.pending.shape[0]
    f = state.feature.astype(self.head.dtype)
    pending_emb = learned.embed(target.config, target.params, ctx.pending)  # [B, E]
    tokens = jnp.zeros((b, self.num_nodes), jnp.int32)  # target ids, filled level by level
    recent = self.recent_vocab(target, ctx)
    sampled = self.children.used(target.sampling) != "top_k"

    def level_logits(d, parents, tokens):  # [B, P, Vd (+ R)]; tokens: target ids drafted so far
      # The conditioning tokens of each parent: pending, then the parent's path in the tree.
      embs = [jnp.broadcast_to(pending_emb[:, None], (b, len(parents), f.shape[-1]))]
      if d > 1:
        paths = np.asarray([_ancestors(self.template, int(p)) for p in parents])  # [P, d-1]
        embs.append(learned.embed(target.config, target.params, tokens[:, paths]))
      embs = jnp.concatenate([embs[0][:, :, None], *embs[1:]], axis=2)  # [B, P, d, E]
      h = heads[d - 1](jnp.broadcast_to(f[:, None], embs.shape[:2] + f.shape[-1:]), embs)
      return learned.with_recent(
          jnp.einsum("BPE,EV->BPV", h, self.head, preferred_element_type=jnp.float32), h, recent)

    if sampled:
      def level_logp(d, parents, draft_ids):
        return learned.draft_logprobs(level_logits(d, parents,
                                                   self.to_target_ids(draft_ids, recent)))

      ids, valid, draft = static_tree.sample_template(
          self.template, self.children, target.sampling, ctx.rng, level_logp, b)
      tree = self.template.tree(ids, valid=valid, draft=draft)
      return self.with_targets(tree, recent), state, ctx.cache
    for d, (nodes, parents, slot) in enumerate(static_tree.template_levels(self.template),
                                               start=1):
      logits = level_logits(d, parents, tokens)
      k = int(self.template.rank[nodes].max()) + 1
      _, ranked = jax.lax.top_k(logits, k)  # [B, P, k]
      picked = ranked[:, slot, self.template.rank[nodes]]  # [B, nodes]
      tokens = tokens.at[:, nodes].set(self.to_target_ids(picked, recent))
    return self.template.tree(tokens), state, ctx.cache


class HydraFamily(static_tree.StaticTreeFamily):
  name = "hydra"
  description = "Medusa heads conditioned on the tokens drafted before them (Hydra)"
  module = HydraHeads
  config_cls = HydraConfig
  drafter_cls = Hydra
  options_cls = HydraOptions

  def depth_logits(self, net, params, x, num_steps, *, train=False):
    """Head s + 1 on the feature at t, conditioned on the true tokens t + 1 .. t + s + 1
    (teacher forcing; rows past the end see zero embeddings), predicts the token at t + s + 2."""
    heads = learned.merge(HydraHeads, net, params).heads
    t = x.tokens.shape[1]
    shifted = [jnp.take(x.emb, jnp.pad(x.tokens[:, j:], ((0, 0), (0, j))), axis=0)
               * (jnp.arange(t) < t - j)[None, :, None] for j in range(1, num_steps + 1)]
    out = []
    for s in range(num_steps):
      h = heads[s](x.feats, jnp.stack(shifted[:s + 1], axis=2))
      out.append(jnp.einsum("BTE,EV->BTV", h, x.head, preferred_element_type=jnp.float32))
    return jnp.stack(out), jnp.zeros((), jnp.float32)


FAMILY = io.register_family(HydraFamily())
