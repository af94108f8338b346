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
import json

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax import trees
from specjax.drafters import io, learned
from specjax.drafters.base import DraftContext, Prefill, RoundResult, TargetView


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  hidden_size: int  # E of the target
  num_heads: int = 4  # K: head k predicts the token k + 1 after the last committed one
  dtype: str = "float32"

  def with_dtype(self, dtype: str) -> "MedusaConfig":
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


# Named trees for 4 heads ("choices"): wide where the heads are sure, deep along rank 0. Which is
# fastest depends on how much a node costs to verify (experiments/tune_tree.py measures it).
TREES = {
    "chain4": ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)),
    "tree6": ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)),
    "tree8": ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)),
    "tree11": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
               (1, 0, 0), (0, 0, 0, 0)),
    "tree15": ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
               (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)),
}
DEFAULT_CHOICES = TREES["tree15"]


def check_template(template: trees.TreeTemplate, num_heads: int, vocab: int) -> None:
  if template.max_depth > num_heads:
    raise ValueError(f"tree depth {template.max_depth} exceeds the drafter's {num_heads} heads")
  if int(template.rank.max()) >= vocab:
    raise ValueError(f"tree rank {int(template.rank.max())} >= draft vocabulary {vocab}")


@struct.dataclass
class HeadState:
  feature: jax.Array  # [B, E] target hidden state at the last committed position


def last_feature_at_prefill(prefill: Prefill) -> HeadState:
  """The feature whose LM-head output produced `pending` (the last prompt position)."""
  return HeadState(learned.take_rows(prefill.hidden[0], prefill.hist_len - 2))


def last_feature_after_round(state: HeadState, result: RoundResult) -> HeadState:
  """The feature of the last accepted block row: its logits produced the bonus (new pending)."""
  acc = result.acceptance
  row = jnp.take_along_axis(acc.path, acc.n_accepted[:, None], axis=1)[:, 0]
  feature = learned.take_rows(result.hidden[0], row)
  return HeadState(jnp.where(result.live[:, None], feature, state.feature))


@struct.dataclass
class StaticTreeDrafter(learned.LearnedDrafter):
  """Heads on the last committed hidden state filling a static template (Medusa, Hydra)."""

  net: object = struct.field(pytree_node=False, default=None)
  template: trees.TreeTemplate = struct.field(pytree_node=False, default=None)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
  sampled: bool = struct.field(pytree_node=False, default=False)  # top-k children: one-hot q

  @property
  def num_nodes(self) -> int:
    return self.template.num_nodes

  def init(self, target: TargetView, prefill: Prefill) -> HeadState:
    return last_feature_at_prefill(prefill)

  def update(self, target: TargetView, state: HeadState, result: RoundResult) -> HeadState:
    return last_feature_after_round(state, result)


@struct.dataclass
class Medusa(StaticTreeDrafter):

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


def depth_logits(net: MedusaConfig, params, head, feats, tokens, emb_table, num_steps: int):
  """Training view: logits[s, b, t] over the draft vocabulary for the token at t + s + 2."""
  h = learned.merge(MedusaHeads, net, params)(feats)  # [B, T, K, E]
  logits = jnp.einsum("BTKE,EV->KBTV", h[:, :, :num_steps], head,
                      preferred_element_type=jnp.float32)
  return logits, jnp.zeros((), jnp.float32)


def parse_choices(choices):
  """Tree paths from a name in TREES, a tuple of paths, or their JSON text (a --set override)."""
  if choices is None:
    return None
  if isinstance(choices, str):
    if choices in TREES:
      return TREES[choices]
    choices = json.loads(choices)
  return tuple(tuple(int(r) for r in path) for path in choices)


def assemble_static(drafter_cls):
  """`Family.assemble` for static-tree drafters: the template from `choices`, the target's LM
  head restricted to the draft vocabulary, `recent_tokens` (`LearnedDrafter.recent_vocab`)."""

  def assemble(net, params, d2t, target, hidden_layers, *, choices=None, recent_tokens=0):
    template = trees.TreeTemplate.from_paths(parse_choices(choices) or DEFAULT_CHOICES)
    check_template(template, net.num_heads, d2t.shape[0])
    head = learned.restricted_head(target.config, target.params, d2t).astype(net.dtype)
    return drafter_cls(params=params, d2t=d2t, head=head,
                       recent_tokens=learned.check_recent_tokens(recent_tokens), net=net,
                       template=template, hidden_layers=hidden_layers)

  return assemble


def _make_config(target_cfg, *, num_heads: int = 4, **_) -> MedusaConfig:
  return MedusaConfig(target_cfg.hidden_size, num_heads)


FAMILY = io.register_family(io.Family(
    name="medusa", module=MedusaHeads, config_cls=MedusaConfig,
    hidden_layers=lambda cfg: (cfg.num_layers,), make_config=_make_config,
    assemble=assemble_static(Medusa), depth_logits=depth_logits, uses_target_head=True),
    description="K residual heads on the last hidden state, static tree (Medusa-1)")
