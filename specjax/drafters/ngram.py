"""An n-gram model of prompt + output, drafting a chain token by token.

Prompt lookup copies what followed one earlier occurrence of the history's last n-gram. This
drafter treats the history as a variable-order n-gram model instead (the online n-gram drafting
of SuffixDecoding and ANPD, over the request's own tokens): the next draft token is the
continuation seen most often after the longest suffix of `history + draft so far` (of order
`max_ngram` down to `min_ngram`) that occurred earlier, ties going to the most recent; the token
is appended and the next one drafted from the new suffix. Where a loop or a repeated phrase
recurs it keeps following it past the point where one copied continuation would end, and where
several continuations compete it takes the usual one rather than the latest.

Continuations are read from the history only (positions before `hist_len`), never from the
tokens drafted this round. The draft stops at the first position without a match: that node and
the ones after it are invalid. Model-free, no state, deterministic children: verified with
recursive rejection (lossless at any temperature).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from specjax import checks, trees
from specjax.drafters.base import DraftContext, Stateless, TargetFacts, TargetView
from specjax.drafters.prompt_lookup import history_suffix, suffix_matches
from specjax.drafters.registry import register


def most_frequent(tokens: jax.Array, candidate: jax.Array, vocab_size: int
                  ) -> tuple[jax.Array, jax.Array]:
  """The most frequent of `tokens[candidate]` (int32[W], bool[W]), ties going to the token whose
  last candidate position is latest, and whether there was any candidate (token 0 when not: an
  invalid node's token is still embedded, so it must be an id). Counts by one scatter-add into
  the vocabulary: O(W + V), cheaper on a CPU than sorting the W candidates."""
  counts = jnp.zeros((vocab_size,), jnp.int32).at[tokens].add(candidate.astype(jnp.int32),
                                                               mode="drop")
  count = jnp.where(candidate, jnp.take(counts, tokens, mode="clip"), 0)
  best = count.max()
  pick = jnp.argmax(jnp.where(candidate & (count == best), jnp.arange(tokens.shape[0]), -1))
  return jnp.where(best > 0, tokens[pick], 0), best > 0


@struct.dataclass
class NGram(Stateless):
  num_tokens: int = struct.field(pytree_node=False, default=7)
  max_ngram: int = struct.field(pytree_node=False, default=3)
  min_ngram: int = struct.field(pytree_node=False, default=1)
  # The draft's length is floor(match_scale * m), at most num_tokens, m the longest suffix of the
  # history that occurred before (None: always num_tokens).
  match_scale: float | None = struct.field(pytree_node=False, default=1.0)
  verify_sizes: tuple[int, ...] = struct.field(pytree_node=False, default=(0, 3))
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
  built_for: TargetFacts | None = struct.field(pytree_node=False, default=None)

  @property
  def num_nodes(self) -> int:
    return self.num_tokens

  @property
  def max_match(self) -> int:
    """The match length from which the draft has its full length (the longest one measured)."""
    if self.match_scale is None:
      return 0
    return math.ceil(self.num_tokens / self.match_scale)

  def _row(self, history: jax.Array, hist_len: jax.Array, vocab_size: int):
    """Tokens int32[N] and validity bool[N] of one row's chain."""
    m = max(self.max_ngram, self.max_match)
    suffix = history_suffix(history, hist_len, m)
    orders = suffix_matches(history, hist_len, suffix, hist_len)
    if self.match_scale is None:
      length = self.num_tokens
    else:  # orders nest: the longest match is the number of orders that have one
      longest = sum(o.any().astype(jnp.int32) for o in orders)
      length = jnp.minimum(jnp.floor(self.match_scale * longest).astype(jnp.int32),
                           self.num_tokens)
    suffix = suffix[m - self.max_ngram:]
    tokens, valid, ok = [], [], jnp.bool_(True)
    for j in range(self.num_tokens):
      if j:
        orders = suffix_matches(history, hist_len, suffix, hist_len + j)
      # The longest order with a match (orders refine each other: a longer match is a shorter
      # one too); no match at any order leaves no candidate.
      starts = jnp.zeros_like(orders[0])
      for n in range(self.min_ngram, self.max_ngram + 1):
        starts = jnp.where(orders[n - 1].any(), orders[n - 1], starts)
      # A start c continues with history[c].
      token, found = most_frequent(history, starts, vocab_size)
      ok &= found
      tokens.append(token)
      valid.append(ok & (j < length))
      suffix = jnp.concatenate([suffix[1:], token[None]])
    return jnp.stack(tokens), jnp.stack(valid)

  def draft(self, target: TargetView, state, ctx: DraftContext):
    tokens, valid = jax.vmap(functools.partial(self._row, vocab_size=target.config.vocab_size)
                             )(ctx.history, ctx.hist_len)
    return trees.chain(tokens, valid=valid), state, ctx.cache


@register("ngram", description="n-gram model of prompt + output, token by token, as long as the "
          "match (model-free)")
def build(target, *, num_tokens: int = 7, max_ngram: int = 3, min_ngram: int = 1,
          match_scale: float | None = 1.0, verify_sizes=(0, 3)) -> NGram:
  """num_tokens, max_ngram, min_ngram: ints, the longest draft and the n-gram orders, which fit
  the target's context. match_scale: a positive number (None: drafts are always num_tokens
  long). verify_sizes: the shorter drafts verified in a smaller target call (ints in
  [0, num_tokens]; `specjax.drafters.base`). Model-free: `target` may be None (no context
  bound, no target recorded)."""
  context = None if target is None else target.config.max_position_embeddings
  num_tokens = checks.integer("ngram num_tokens", num_tokens, lo=1, hi=context)
  max_ngram = checks.integer("ngram max_ngram", max_ngram, lo=1, hi=context)
  min_ngram = checks.integer("ngram min_ngram", min_ngram, lo=1, hi=context)
  if min_ngram > max_ngram:
    raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
  if match_scale is not None:
    match_scale = checks.real("ngram match_scale", match_scale)
    if not match_scale > 0:
      raise ValueError(f"ngram match_scale must be > 0 (or None: fixed length), got "
                       f"{match_scale}")
  sizes = checks.sizes("ngram verify_sizes", verify_sizes, num_tokens)
  return NGram(num_tokens, max_ngram, min_ngram, match_scale, sizes,
               built_for=None if target is None else TargetFacts.of(target.config))
