"""Token Recycling (Luo et al. 2024): recycle the target's own top-k candidates as drafts.

State: an adjacency table `int32[V, k]`, row t holding the target's k most likely next tokens the
last time t was verified. Every verification refreshes the rows of all N+1 block tokens from the
target logits it computed anyway; the prompt's prefill seeds the table the same way. A draft is a
static template tree (Medusa-style choices over ranks) filled breadth-first: a node of rank r
below a node with token t gets `table[t, r]`. Children are deterministic, so verification uses
recursive rejection and is lossless at any temperature.

The table is a pytree leaf of the drafter and the final table is returned by `generate` in
`result.drafter_state`, so it can be carried across calls as the paper does
(`drafter.replace(table=result.drafter_state)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import checks
from specjax.drafters.base import DraftContext, Prefill, RoundResult, TargetFacts, TargetView
from specjax.drafters.registry import register
from specjax.models import decoder
from specjax.trees import TreeTemplate

# An 8-node template: two candidates at the first two levels, where most rejections happen, and a
# chain below rank 0. Small on purpose: where a small target is compute-bound (a CPU), each
# verified node costs a visible fraction of a target step, so a wide tree (the paper's 80 nodes
# suit a GPU) would cost more than it gains. Pass `paths=` for other hardware.
DEFAULT_PATHS = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))


@struct.dataclass
class TokenRecycling:
  table: jax.Array  # int32[V, k] initial adjacency table (all zeros = no knowledge)
  target_layers: int = struct.field(pytree_node=False)  # L: init reads the final normed states
  paths: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False, default=DEFAULT_PATHS)
  built_for: TargetFacts | None = struct.field(pytree_node=False, default=None)

  @property
  def template(self) -> TreeTemplate:
    return TreeTemplate.from_paths(self.paths)

  @property
  def num_nodes(self) -> int:
    return self.template.num_nodes

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    return (self.target_layers,)

  def _refresh(self, table: jax.Array, tokens: jax.Array, logits: jax.Array,
               live: jax.Array) -> jax.Array:
    """table[tokens] <- top-k of logits, for live rows; tokens: int32[R], logits: [R, V]."""
    top = jax.lax.top_k(logits, table.shape[1])[1].astype(jnp.int32)
    rows = jnp.where(live, tokens, table.shape[0])  # dead rows write out of bounds: dropped
    return table.at[rows].set(top, mode="drop")

  def init(self, target: TargetView, prefill: Prefill) -> jax.Array:
    # Seed from the prefill: each prompt token's row gets the target's top-k after it. The
    # prefill computed logits only at the last prompt token, so recompute the unembedding over
    # the prompt's final hidden states (one matmul, no extra layer).
    b, p = prefill.hidden.shape[1:3]
    logits = decoder.lm_head(target.config, target.params, prefill.hidden[0])  # [B, P, V]
    pos = jnp.arange(p)[None, :]
    live = pos < (prefill.hist_len - 1)[:, None]  # real prompt positions
    return self._refresh(self.table, prefill.history[:, :p].reshape(-1),
                         logits.reshape(b * p, -1), live.reshape(-1))

  def draft(self, target: TargetView, table: jax.Array, ctx: DraftContext):
    tpl = self.template
    tokens = []
    for i in range(tpl.num_nodes):  # topological order: a parent's token is known first
      parent_tok = ctx.pending if tpl.parent[i] < 0 else tokens[tpl.parent[i]]
      tokens.append(table[parent_tok, tpl.rank[i]])
    tree = tpl.tree(jnp.stack(tokens, axis=1))
    return tree, table, ctx.cache

  def update(self, target: TargetView, table: jax.Array, result: RoundResult) -> jax.Array:
    b, t = result.block_tokens.shape
    live = jnp.broadcast_to(result.live[:, None], (b, t))
    return self._refresh(table, result.block_tokens.reshape(-1),
                         result.logits.reshape(b * t, -1), live.reshape(-1))


@register("token_recycling", description="adjacency table of the target's top-k (model-free)")
def build(target, *, paths=DEFAULT_PATHS, k: int | None = None) -> TokenRecycling:
  """paths: the template's rank paths (non-empty); k: candidates kept per token, in [largest
  rank + 1, vocab_size] (default the least that fills the template). The table is V x k ints,
  allocated here: both are checked first."""
  if isinstance(paths, (str, bytes)) or not all(isinstance(p, (list, tuple)) for p in paths):
    raise ValueError(f"token_recycling paths must be a sequence of rank paths (tuples of ints), "
                     f"got {paths!r}")
  paths = tuple(tuple(p) for p in paths)
  if not paths:
    raise ValueError("token_recycling paths must hold at least one rank path")
  template = TreeTemplate.from_paths(paths)
  vocab = target.config.vocab_size
  need = int(max(template.rank)) + 1
  k = need if k is None else checks.integer("token_recycling k", k)
  if k < need:
    raise ValueError(f"k={k} is smaller than the template's largest rank + 1: token_recycling k "
                     f"must be in [{need}, {vocab}]")
  if k > vocab:
    raise ValueError(f"k={k} exceeds the vocabulary: token_recycling k must be in [{need}, "
                     f"{vocab}]")
  return TokenRecycling(jnp.zeros((vocab, k), jnp.int32), target.config.num_layers, paths,
                        built_for=TargetFacts.of(target.config))
