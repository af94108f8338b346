"""Prompt lookup decoding: propose what followed the last n-gram earlier in prompt + output.

The suffix of the history (its last n tokens, n from `max_ngram` down to `min_ngram`) is matched
against every earlier position; each of the `num_branches` best matches (longer n first, then
the most recent) proposes the `num_tokens` tokens that followed it, as one branch of the tree.
Branches start with distinct tokens, so siblings never duplicate each other. Model-free, no
state, deterministic children: verified with recursive rejection (lossless at any temperature).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import checks, trees
from specjax.drafters.base import DraftContext, Stateless, TargetFacts, TargetView
from specjax.drafters.registry import register
from specjax.trees import Tree


def branch_structure(num_branches: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """parent, depth: int32[N] of `num_branches` chains hanging from the root, branch-major."""
  i = np.arange(num_branches * length)
  pos = i % length
  return np.where(pos == 0, -1, i - 1).astype(np.int32), (pos + 1).astype(np.int32)


def suffix_matches(history: jax.Array, hist_len: jax.Array, suffix: jax.Array,
                   suffix_len: jax.Array) -> list[jax.Array]:
  """One row's n-gram matches of a sequence's suffix, for every order n = 1..M.

  history: int32[W], its first hist_len tokens real; suffix: int32[M], the last M tokens of the
  sequence being continued (newest last), of which the last `suffix_len` exist (fewer than M at
  the start of a sequence). Entry n - 1 is bool[W]: c is a continuation start of order n, i.e.
  c < hist_len (a continuation token exists) and history[c - n : c] equals the suffix's last n
  tokens. Each order refines the one below it (an n-gram match is an (n - 1)-gram match).
  """
  w, m = history.shape[0], suffix.shape[0]
  c = jnp.arange(w)
  ok = c < hist_len
  orders = []
  for n in range(1, m + 1):
    # history[c - n] by a static roll; the wrapped entries are the c < n masked out.
    ok &= (c >= n) & (suffix_len >= n) & (jnp.roll(history, n) == suffix[m - n])
    orders.append(ok)
  return orders


def history_suffix(history: jax.Array, hist_len: jax.Array, m: int) -> jax.Array:
  """int32[M]: the last m tokens of one row's history (newest last; junk before its start)."""
  return history[jnp.clip(hist_len - m + jnp.arange(m), 0, history.shape[0] - 1)]


@struct.dataclass
class PromptLookup(Stateless):
  num_tokens: int = struct.field(pytree_node=False, default=3)
  num_branches: int = struct.field(pytree_node=False, default=1)
  max_ngram: int = struct.field(pytree_node=False, default=3)
  min_ngram: int = struct.field(pytree_node=False, default=1)
  # Node counts below N a round is also verified at (`specjax.drafters.base`): by default 0, the
  # round without a match, which then costs one autoregressive step.
  verify_sizes: tuple[int, ...] = struct.field(pytree_node=False, default=(0,))
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
  built_for: TargetFacts | None = struct.field(pytree_node=False, default=None)

  @property
  def num_nodes(self) -> int:
    return self.num_tokens * self.num_branches


  def _row(self, history: jax.Array, hist_len: jax.Array):
    """Tokens int32[N] and validity bool[N] of one row's branches."""
    w = history.shape[0]
    # score = n * W + c: longer n-grams first, then the most recent continuation; -1 = none.
    orders = suffix_matches(history, hist_len, history_suffix(history, hist_len, self.max_ngram),
                            hist_len)
    score = jnp.full((w,), -1, jnp.int32)
    for n in range(self.min_ngram, self.max_ngram + 1):
      score = jnp.where(orders[n - 1], n * w + jnp.arange(w), score)
    tokens, valid = [], []
    for _ in range(self.num_branches):
      best = score.max()
      c = best % w
      follow = c + jnp.arange(self.num_tokens)
      toks = history[jnp.clip(follow, 0, w - 1)]
      ok = (best >= 0) & (follow < hist_len)
      tokens.append(toks)
      valid.append(ok)
      # Later branches must start with another token: siblings never duplicate each other.
      score = jnp.where(ok[0] & (history == toks[0]), -1, score)
    return jnp.concatenate(tokens), jnp.concatenate(valid)

  def draft(self, target: TargetView, state, ctx: DraftContext):
    tokens, valid = jax.vmap(self._row)(ctx.history, ctx.hist_len)
    parent, depth = branch_structure(self.num_branches, self.num_tokens)
    b = tokens.shape[0]
    tree = Tree(tokens=tokens, parent=jnp.broadcast_to(parent, (b, self.num_nodes)),
                depth=jnp.broadcast_to(depth, (b, self.num_nodes)), valid=valid,
                chain=trees.is_chain(parent))
    return tree, state, ctx.cache



@register("prompt_lookup", description="n-gram match in prompt + output (model-free)")
def build(target, *, num_tokens: int = 3, num_branches: int = 1, max_ngram: int = 3,
          min_ngram: int = 1, verify_sizes=(0,)) -> PromptLookup:
  """Options are ints; the tree (num_tokens * num_branches nodes) and the n-grams fit the
  target's context; verify_sizes: node counts in [0, num_tokens * num_branches] (a chain's
  shorter continuations, near the end of the history, can use them too). Model-free: `target`
  may be None (no context bound, no target recorded)."""
  context = None if target is None else target.config.max_position_embeddings
  num_tokens = checks.integer("prompt_lookup num_tokens", num_tokens, lo=1, hi=context)
  num_branches = checks.integer("prompt_lookup num_branches", num_branches, lo=1,
                                hi=None if context is None else context // num_tokens)
  max_ngram = checks.integer("prompt_lookup max_ngram", max_ngram, lo=1, hi=context)
  min_ngram = checks.integer("prompt_lookup min_ngram", min_ngram, lo=1, hi=context)
  if min_ngram > max_ngram:
    raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
  sizes = checks.sizes("prompt_lookup verify_sizes", verify_sizes, num_tokens * num_branches)
  return PromptLookup(num_tokens, num_branches, max_ngram, min_ngram, sizes,
                      built_for=None if target is None else TargetFacts.of(target.config))
