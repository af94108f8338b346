"""Attention over `[committed prefix | new tokens]`, with pluggable implementations.

Every forward pass of the decoder is the same computation: T new queries attend to the committed
prefix of the cache (slots `< length`) plus those of the new tokens that `new_mask` allows.
Prefill is `length = 0` with a causal `new_mask`; a decode step is T = 1; verifying a draft tree
is T = N with the tree's ancestor-or-self mask. Implementations are registered here by name and
chosen by `ModelConfig.attention_impl`. `"pallas"` (`specjax.models.pallas_attention`) is a lazy
entry, imported on its first `get_attention_impl`, so importing specjax never imports Pallas.
"""

from __future__ import annotations

import importlib
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


# The one registry of implementations. A lazy entry names the module that defines it (as
# "module:attribute"): resolving it on first use keeps the kernel's imports off every other path.
_IMPLS: dict[str, AttentionFn] = {"xla": xla_attention}
_LAZY: dict[str, str] = {"pallas": "specjax.models.pallas_attention:pallas_attention"}


def register_attention_impl(name: str, fn: AttentionFn) -> None:
  """Makes `fn` selectable as `ModelConfig(attention_impl=name)`; replaces any entry of `name`."""
  _LAZY.pop(name, None)
  _IMPLS[name] = fn


def attention_impls() -> list[str]:
  """The registered names, lazy ones included (what `ModelConfig` accepts)."""
  return sorted(_IMPLS.keys() | _LAZY.keys())


def get_attention_impl(name: str) -> AttentionFn:
  """The AttentionFn of `name`; a lazy entry's module is imported here, once."""
  if name in _LAZY:
    module, attr = _LAZY[name].split(":")
    fn = getattr(importlib.import_module(module), attr)
    register_attention_impl(name, fn)
  if name not in _IMPLS:
    raise ValueError(f"unknown attention_impl {name!r}; registered: {attention_impls()}")
  return _IMPLS[name]
