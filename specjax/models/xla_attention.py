"""The reference attention over `[committed prefix | new tokens]`: the `AttentionFn` protocol,
its mask, and `xla_attention`, masked softmax in plain jnp.

Every forward pass of the decoder is the same computation: T new queries attend to the committed
prefix of the cache (slots `< length`) plus those of the new tokens that `new_mask` allows.
Prefill is `length = 0` with a causal `new_mask`; a decode step is T = 1; verifying a draft tree
is T = N with the tree's ancestor-or-self mask.

This module lies below the registry of implementations (`specjax.models.attention`, which
imports the lazy ones on first use): an implementation that falls back on XLA for some shapes
(`pallas_attention`) imports it here, not from the registry that imports it.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

# Large finite negative rather than -inf: a fully masked row then gives a uniform (ignored) result
# instead of NaN, which matters for padded rows of a ragged batch.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class AttentionFn(Protocol):

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array | None,
               new_mask: jax.Array, *, sm_scale: float) -> jax.Array:
    """q: [B, T, H, D]; k, v: [B, S, K, D]; length: int32[B] or None; new_mask: bool[B, T, T].

    With `length`, slots `[length, length + T)` of k/v hold the new tokens and slots `< length`
    the committed prefix. With `length=None` there is no prefix: k/v are the new tokens (S == T).
    Returns [B, T, H, D]. A model with attention soft-capping (Gemma 2) also passes
    `softcap=cap`: the scaled scores become tanh(scores / cap) * cap before the mask; an
    implementation without that keyword cannot run such a model.
    """


def full_mask(length: jax.Array | None, new_mask: jax.Array, num_slots: int) -> jax.Array:
  """bool[B, T, S]: query t sees slot j iff j < length or new_mask[t, j - length]."""
  if length is None:
    return new_mask
  t = new_mask.shape[-1]
  rel = jnp.arange(num_slots)[None, :] - length[:, None]  # [B, S] slot index within the new block
  in_new = (rel >= 0) & (rel < t)
  sees_new = jnp.take_along_axis(
      new_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :],
                                 new_mask.shape[:2] + (num_slots,)), axis=-1)
  return (rel < 0)[:, None, :] | (in_new[:, None, :] & sees_new)


def xla_attention(q, k, v, length, new_mask, *, sm_scale, softcap=None):
  """Masked softmax attention with GQA grouping, in plain jnp (XLA fuses it).

  The scores are laid out [B, K, S, G, T], cache slots before queries: on a CPU the score
  matmul then comes out in that order without a transpose of the scores, and the softmax sums
  over slots for all of a head group's queries at once. (With the slots last, XLA transposed
  every layer's scores; this order made prefill 7% faster and an oracle chain of 7 4% faster on
  the embedded target over 2 cores.)"""
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(b, t, kv_heads, h // kv_heads, d)  # [B, T, K, G, D]
  scores = jnp.einsum("BTKGD,BSKD->BKSGT", qg, k, preferred_element_type=jnp.float32) * sm_scale
  if softcap is not None:  # Gemma 2, in float32 as the scores are
    scores = jnp.tanh(scores / softcap) * softcap
  mask = full_mask(length, new_mask, k.shape[1])  # [B, T, S]
  scores = jnp.where(jnp.swapaxes(mask, 1, 2)[:, None, :, None, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=2).astype(v.dtype)
  out = jnp.einsum("BKSGT,BSKD->BTKGD", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d).astype(q.dtype)
