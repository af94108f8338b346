"""Classic speculative sampling with an independent draft LM (Leviathan et al.; Chen et al.).

A smaller LM with the same tokenizer drafts a chain of `num_tokens` tokens autoregressively with
its own KV cache: argmax when greedy, sampled from q (its distribution processed with the same
temperature / top-k / top-p) otherwise, verified with the q-based rule. Its cache follows the
target's history: each round first feeds the one or two tokens it has not seen (the last
round's bonus token, and the last accepted draft when the whole chain was accepted), then drafts;
after verification its length rolls back to the accepted prefix.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax import assets, checks, trees
from specjax.children import SAMPLED_CHAIN, Children
from specjax.drafters.base import DraftContext, Prefill, RoundResult, TargetFacts, TargetView
from specjax.drafters.registry import register
from specjax.interop.tokenizer import tokenizer_fingerprint
from specjax.models import decoder
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.sampling import draft_sample


@struct.dataclass
class DraftLMState:
  cache: KVCache  # the draft LM's own cache; `length` tokens of history are in it
  base: jax.Array  # int32[B] cache length after the catch-up tokens of this round


@struct.dataclass
class DraftLM:
  params: nnx.State
  config: ModelConfig = struct.field(pytree_node=False)
  num_tokens: int = struct.field(pytree_node=False, default=1)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
  built_for: TargetFacts | None = struct.field(pytree_node=False, default=None)

  @property
  def num_nodes(self) -> int:
    return self.num_tokens

  @property
  def children(self) -> Children:
    """A chain of draws from q: each node the one i.i.d. child of the one before."""
    return SAMPLED_CHAIN

  @property
  def partition_config(self) -> ModelConfig:
    """The draft LM is a decoder: the target's rules, resolved against its own config."""
    return self.config

  def init(self, target: TargetView, prefill: Prefill) -> DraftLMState:
    b, p = prefill.prompt.shape
    prompt_len = prefill.hist_len - 1
    cache = decoder.init_cache(self.config, b, prefill.history.shape[1])
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = decoder.forward(self.config, self.params, prefill.prompt, positions,
                          decoder.causal_mask(prompt_len, p), cache,
                          logits_index=jnp.zeros((b, 1), jnp.int32))  # logits unused
    return DraftLMState(out.cache.advance(prompt_len), prompt_len)

  def draft(self, target: TargetView, state: DraftLMState, ctx: DraftContext):
    b = ctx.pending.shape[0]
    cache = state.cache
    start = cache.length
    n_new = ctx.hist_len - start  # 1 or 2 tokens the draft cache has not seen; the last: pending
    idx = start[:, None] + jnp.arange(2)[None, :]
    feed = jnp.take_along_axis(ctx.history, jnp.clip(idx, 0, ctx.history.shape[1] - 1), axis=1)
    mask = jnp.tril(jnp.ones((2, 2), bool))[None] & (jnp.arange(2)[None, None, :]
                                                     < n_new[:, None, None])
    out = decoder.forward(self.config, self.params, feed, idx, mask, cache,
                          logits_index=(n_new - 1)[:, None])
    cache = out.cache.advance(n_new)
    base = cache.length
    keys = jax.random.split(ctx.rng, self.num_tokens)
    first, q0 = draft_sample(keys[0], out.logits[:, 0], target.sampling)
    one = jnp.ones((b, 1, 1), bool)

    def step(carry, key):
      cache, tok = carry
      out = decoder.forward(self.config, self.params, tok[:, None], cache.length[:, None], one,
                            cache)
      nxt, q = draft_sample(key, out.logits[:, 0], target.sampling)
      return (out.cache.advance(jnp.ones((b,), jnp.int32)), nxt), (nxt, q)

    (cache, _), (rest, q_rest) = jax.lax.scan(step, (cache, first), keys[1:])
    tokens = jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
    q = None
    if q0 is not None:
      q = jnp.concatenate([q0[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
    return trees.chain(tokens, q=q), DraftLMState(cache, base), ctx.cache

  def update(self, target: TargetView, state: DraftLMState, result: RoundResult):
    # Keep the catch-up tokens and the accepted drafts it has fed (d_1 .. d_{N-1} at most).
    n = jnp.minimum(result.acceptance.n_accepted, self.num_tokens - 1)
    return DraftLMState(state.cache.replace(length=state.base + n), state.base)


def check_compatible(draft, target) -> None:
  """Raises ValueError unless the draft LM can propose tokens in the target's vocabulary."""
  if draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"draft LM vocab_size {draft.config.vocab_size} != target vocab_size "
                     f"{target.config.vocab_size}")
  a, b = tokenizer_fingerprint(draft.tokenizer), tokenizer_fingerprint(target.tokenizer)
  if a is not None and b is not None and a != b:
    raise ValueError("the draft LM's tokenizer differs from the target's: token ids would not "
                     "mean the same thing")


def _usable(target) -> bool:
  path = os.path.join(assets.DRAFT_LM_DIR, "config.json")
  if not os.path.exists(path):
    return False
  cfg = ModelConfig.from_json_file(path)
  if cfg.vocab_size != target.config.vocab_size or target.tokenizer is None:
    return False
  from specjax.interop.tokenizer import load_tokenizer
  tok = load_tokenizer(assets.DRAFT_LM_DIR)
  return tokenizer_fingerprint(tok) == tokenizer_fingerprint(target.tokenizer)


@register("draft_lm", usable=_usable,
          description="an independent small LM with the same tokenizer (classic SpS)")
def build(target, *, path: str | None = None, num_tokens: int = 1, draft=None) -> DraftLM:
  """path: an HF folder of the draft LM (default: the shipped one); or pass a loaded `draft`.

  num_tokens defaults to 1, the fastest chain for the shipped pair on 2 CPU cores, where each
  verified token costs a good part of a step: on 8 held-out stdlib prompts x 128 tokens, 1, 2,
  3, 4 tokens ran at 1.05x, 0.97x, 0.91x, 0.79x autoregressive speed (tau 1.46, 1.60, 1.64,
  1.66). Where verifying a block costs about one step (an accelerator), longer chains pay."""
  num_tokens = checks.integer("draft_lm num_tokens", num_tokens, lo=1,
                              hi=target.config.max_position_embeddings)
  if draft is None:
    if path is not None and not isinstance(path, (str, os.PathLike)):
      raise ValueError(f"draft_lm path must be a folder name (str or os.PathLike), got {path!r}")
    from specjax.interop.hf import load_target
    draft = load_target(path or assets.DRAFT_LM_DIR, dtype=target.config.dtype)
  elif not (hasattr(draft, "config") and hasattr(draft, "params")):
    raise ValueError(f"draft_lm draft must be a loaded specjax.Target, got "
                     f"{type(draft).__name__}")
  check_compatible(draft, target)
  return DraftLM(draft.params, draft.config, num_tokens,
                 built_for=TargetFacts.of(target.config))
