"""Drafters, one file per family, behind one protocol (`specjax.drafters.base.Drafter`).

  specjax.drafters.available(target)            -> names usable with this target
  specjax.drafters.build(name, target, **opts)  -> a drafter for generate(..., drafter=...)

A new drafter is a file that defines a protocol-conforming pytree and registers a builder with
`@register("name")`; the benchmark then picks it up without edits.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from specjax.drafters.base import Drafter, NoDrafter
from specjax.target import Target


@dataclasses.dataclass(frozen=True)
class _Entry:
  build: Callable[..., Drafter]
  usable: Callable[[Target], bool]
  description: str


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, *, usable: Callable[[Target], bool] = lambda target: True,
             description: str = ""):
  """Decorator registering `builder(target, **options) -> Drafter` under `name`."""

  def wrap(builder):
    _REGISTRY[name] = _Entry(builder, usable, description or (builder.__doc__ or "").strip())
    return builder

  return wrap


def names() -> list[str]:
  return sorted(_REGISTRY)


def available(target: Target) -> list[str]:
  """Registered drafters that can run with `target` (e.g. a trained drafter exists for it)."""
  return [n for n in names() if _REGISTRY[n].usable(target)]


def describe(name: str) -> str:
  return _entry(name).description


def build(name: str, target: Target, **options) -> Drafter:
  """Builds drafter `name` for `target`; its builder raises ValueError for what cannot work
  (e.g. a draft LM of another vocabulary). `available` answers for the default options."""
  return _entry(name).build(target, **options)


def _entry(name: str) -> _Entry:
  if name not in _REGISTRY:
    raise ValueError(f"unknown drafter {name!r}; registered: {names()}")
  return _REGISTRY[name]


# Registration happens on import of each family's file.
from specjax.drafters import (draft_lm, eagle, eagle3, hydra, layer_skip, medusa,  # noqa: E402,F401
                              prompt_lookup, token_recycling)

__all__ = ["Drafter", "NoDrafter", "available", "build", "describe", "names", "register"]
