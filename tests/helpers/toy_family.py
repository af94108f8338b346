"""A learned drafter family that exists only in the tests: the proof that a family is one file.

`ToyChain` rolls the target's last committed hidden state forward with one residual map,
h_{d+1} = h_d + tanh(h_d W), and drafts a chain of `num_tokens` argmax tokens through the target's
LM head over the draft vocabulary (depth d reads h_d). Everything the trainer, the loader, the
tree tuner and the comparison need is defined here against the public protocol
(`specjax.drafters.learned.Family`) and registered by the test that uses it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax import trees
from specjax.drafters import learned, static_tree

NAME = "toy_chain"


@dataclasses.dataclass(frozen=True)
class ToyConfig:
  hidden_size: int
  dtype: str = "float32"

  def with_dtype(self, dtype: str) -> ToyConfig:
    return dataclasses.replace(self, dtype=dtype)


class ToyNet(nnx.Module):

  def __init__(self, cfg: ToyConfig, rngs: nnx.Rngs):
    e = cfg.hidden_size
    self.w = nnx.Param(jnp.zeros((e, e), jnp.dtype(cfg.dtype)))  # [E, E]

  def __call__(self, h: jax.Array) -> jax.Array:
    return h + jnp.tanh(h @ self.w[...])


@struct.dataclass
class ToyChain(learned.LearnedDrafter):
  net: ToyConfig = struct.field(pytree_node=False, kw_only=True)  # required, by keyword
  num_tokens: int = struct.field(pytree_node=False, default=3)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())

  @property
  def num_nodes(self) -> int:
    return self.num_tokens

  def init(self, target, prefill):
    return static_tree.last_feature_at_prefill(prefill)

  def update(self, target, state, result):
    return static_tree.last_feature_after_round(state, result)

  def draft(self, target, state, ctx):
    net = learned.merge(ToyNet, self.net, self.params)
    recent = self.recent_vocab(target, ctx)
    h, tokens = state.feature.astype(self.head.dtype), []
    for _ in range(self.num_tokens):
      h = net(h)
      logits = learned.with_recent(h @ self.head, h, recent)
      tokens.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return trees.chain(self.to_target_ids(jnp.stack(tokens, 1), recent)), state, ctx.cache


class ToyFamily(learned.Family):
  name = NAME
  description = "a residual map rolled forward from the last hidden state (test-only)"
  module = ToyNet
  config_cls = ToyConfig

  def make_config(self, target_cfg, *, draft_vocab_size, num_features, options=None):
    return ToyConfig(target_cfg.hidden_size)

  def depth_logits(self, net, params, x, num_steps, *, train=False):
    module, h, out = learned.merge(ToyNet, net, params), x.feats, []
    for _ in range(num_steps):  # step s + 1 from position t drafts the token at t + s + 2
      h = module(h)
      out.append(jnp.einsum("BTE,EV->BTV", h, x.head, preferred_element_type=jnp.float32))
    return jnp.stack(out), jnp.zeros((), jnp.float32)

  def assemble(self, net, params, d2t, target, hidden_layers, *, num_tokens: int = 3,
               recent_tokens: int = 0):
    if int(num_tokens) < 1:
      raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    head = learned.restricted_head(target.config, target.params, d2t).astype(net.dtype)
    return ToyChain(params=params, d2t=d2t, head=head,
                    recent_tokens=learned.check_recent_tokens(recent_tokens), net=net,
                    num_tokens=int(num_tokens), hidden_layers=tuple(hidden_layers))

  def tree_options(self, spec: str) -> dict:
    if not spec.isdigit():
      raise ValueError(f"tree {spec!r} does not fit {NAME}: use a chain length")
    return dict(num_tokens=int(spec))

  def tune_grid(self) -> list[dict]:
    return [dict(num_tokens=2), dict(num_tokens=3)]
