"""An oracle drafter for roofline measurements: it proposes a known continuation.

Given the target's own greedy continuation of each prompt (computed beforehand), it drafts the
next `num_tokens` tokens of that reference, so at temperature 0 every node is accepted and each
round emits num_tokens + 1 tokens: the loop's best case, used to compare measured speedup with
the bound t_AR_step * (N + 1) / t_verify(N + 1). Not registered: it needs the answer in advance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import trees
from specjax.drafters.base import DraftContext, Stateless, TargetView


@struct.dataclass
class Oracle(Stateless):
  reference: jax.Array  # int32[B, R] the continuation (new tokens only) of each row
  prompt_len: jax.Array  # int32[B]
  num_tokens: int = struct.field(pytree_node=False, default=4)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())

  @property
  def num_nodes(self) -> int:
    return self.num_tokens


  def draft(self, target: TargetView, state, ctx: DraftContext):
    done = ctx.hist_len - self.prompt_len  # new tokens emitted so far (incl. pending)
    idx = done[:, None] + jnp.arange(self.num_tokens)[None, :]
    r = self.reference.shape[1]
    tokens = jnp.take_along_axis(self.reference, jnp.clip(idx, 0, r - 1), axis=1)
    return trees.chain(tokens, valid=idx < r), state, ctx.cache

