"""The drafter registry: names -> builders, and which of them can run with a given target.

  registry.register("name", usable=..., description=...)(builder)   # builder(target, **options)
  registry.available(target) -> names usable with this target
  registry.build(name, target, **options) -> a drafter for generate(..., drafter=...)
  registry.family(name) -> the learned family object behind a name (`learned.Family`)

Family files import this module (never the package facade `specjax.drafters`, which imports the
family files to register them).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from specjax import checks, sharding
from specjax.drafters.base import Drafter
from specjax.target import Target


@dataclasses.dataclass(frozen=True)
class _Entry:
  build: Callable[..., Drafter]
  usable: Callable[[Target], bool]
  description: str
  family: Any = None  # the learned family (specjax.drafters.learned.Family), if it is one


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, *, usable: Callable[[Target], bool] = lambda target: True,
             description: str = "", family: Any = None):
  """Decorator registering `builder(target, **options) -> Drafter` under `name` (a name
  registered again is replaced: re-running a notebook cell redefines the drafter)."""

  def wrap(builder):
    _REGISTRY[name] = _Entry(builder, usable, description or (builder.__doc__ or "").strip(),
                             family)
    return builder

  return wrap


def unregister(name: str) -> None:
  """Removes `name` (a drafter registered for a test or a notebook session)."""
  _entry(name)
  del _REGISTRY[name]


def names() -> list[str]:
  return sorted(_REGISTRY)


def available(target: Target) -> list[str]:
  """Registered drafters that can run with `target` (e.g. a trained drafter exists for it)."""
  return [n for n in names() if _REGISTRY[n].usable(target)]


def families() -> list[str]:
  """Names of the registered learned families (those that train, export and load)."""
  return [n for n in names() if _REGISTRY[n].family is not None]


def family(name: str):
  """The learned family object registered under `name`."""
  entry = _REGISTRY.get(name)
  if entry is None or entry.family is None:
    raise ValueError(f"unknown learned drafter method {name!r}; known: {families()}")
  return entry.family


def describe(name: str) -> str:
  return _entry(name).description


def defaults(name: str) -> dict[str, Any]:
  """The keyword defaults of `name`'s builder: the options `build` uses when not told."""
  params = inspect.signature(_entry(name).build).parameters.items()
  return {k: p.default for k, p in params if p.default is not inspect.Parameter.empty}


def option_names(name: str) -> list[str] | None:
  """The option names `name`'s builder takes, or None when it takes any (a learned family's
  builder passes its tree options on to the family, which checks them)."""
  return checks.keyword_options(_entry(name).build)


def build(name: str, target: Target, **options) -> Drafter:
  """Builds drafter `name` for `target`; its builder raises ValueError for what cannot work
  (e.g. a draft LM of another vocabulary). `available` answers for the default options.
  On a target with a mesh the drafter's arrays are laid out on it (`sharding.place_drafter`)."""
  accepted = option_names(name)
  if accepted is not None:  # a learned family's builder checks its tree options itself
    checks.known_options(f"drafter {name!r}", options, accepted)
  drafter = _entry(name).build(target, **options)
  mesh = getattr(target, "mesh", None)  # model-free builders also accept target=None
  if mesh is not None:
    drafter = sharding.place_drafter(drafter, target, mesh)
  return drafter


def _entry(name: str) -> _Entry:
  if name not in _REGISTRY:
    raise ValueError(f"unknown drafter {name!r}; registered: {names()}")
  return _REGISTRY[name]
