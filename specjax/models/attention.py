"""Attention over `[committed prefix | new tokens]`, with pluggable implementations.

The computation and its reference implementation are `specjax.models.xla_attention`'s
(re-exported here). Implementations are registered here by name and chosen by
`ModelConfig.attention_impl`. `"pallas"` (`specjax.models.pallas_attention`) is a lazy entry,
imported on its first `get_attention_impl`, so importing specjax never imports Pallas.
"""

from __future__ import annotations

from collections.abc import Callable

# AttentionFn, full_mask and xla_attention are this module's API too (the decoder's, the drafters'
# and the tests').
from specjax.models.xla_attention import AttentionFn, full_mask, xla_attention  # noqa: F401


def _pallas() -> AttentionFn:
  from specjax.models.pallas_attention import pallas_attention  # Pallas is imported here, once
  return pallas_attention


# The one registry of implementations. A lazy entry is a function that imports the module defining
# it: calling it on first use keeps the kernel's imports off every other path.
_IMPLS: dict[str, AttentionFn] = {"xla": xla_attention}
_LAZY: dict[str, Callable[[], AttentionFn]] = {"pallas": _pallas}


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
    register_attention_impl(name, _LAZY[name]())
  if name not in _IMPLS:
    raise ValueError(f"unknown attention_impl {name!r}; registered: {attention_impls()}")
  return _IMPLS[name]
