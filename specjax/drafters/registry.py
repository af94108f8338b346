"""The drafter registry: names -> builders, and which of them can run with a given target.

  registry.register("name", usable=..., description=...)(builder)   # builder(target, **options)
  registry.available(target) -> names usable with this target
  registry.build(name, target, **options) -> a drafter for generate(..., drafter=...)

Family files import this module (never the package facade `specjax.drafters`, which imports the
family files to register them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from specjax.drafters.base import Drafter
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
