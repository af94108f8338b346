"""Argument checks shared by `generate`, `SamplingConfig` and the drafter builders.

`int()` and `float()` accept too much (True, 2.5, "3", bytes): a coerced option compiles a
program nobody asked for, or fails deep inside a trace. These checks accept Python and numpy
numbers only and raise ValueError naming the argument and what it may be.
"""

from __future__ import annotations

import inspect
import math

import numpy as np


def is_int(value) -> bool:
  """A Python or numpy integer, not a bool (True is not token id 1)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
  """A Python or numpy integer or float, not a bool or a string."""
  return is_int(value) or isinstance(value, (float, np.floating))


def _type_name(value) -> str:
  return type(value).__name__


def integer(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
  """`value` as an int in [lo, hi] (either bound optional); ValueError naming `name` otherwise."""
  if not is_int(value):
    raise ValueError(f"{name} must be an int, got {value!r} ({_type_name(value)})")
  value = int(value)
  if lo is not None and hi is not None and not lo <= value <= hi:
    raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
  if lo is not None and value < lo:
    raise ValueError(f"{name} must be >= {lo}, got {value}")
  if hi is not None and value > hi:
    raise ValueError(f"{name} must be <= {hi}, got {value}")
  return value


def sizes(name: str, value, most: int) -> tuple[int, ...]:
  """`value`, a list of ints in [0, most], as a sorted tuple without duplicates and without
  `most` itself (a drafter's `verify_sizes` below its N nodes); ValueError naming `name`."""
  if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
    raise ValueError(f"{name} must be a list of ints, got {value!r}")
  return tuple(sorted({integer(f"{name} entry", v, lo=0, hi=most) for v in value} - {most}))


def real(name: str, value) -> float:
  """`value` as a float; ValueError naming `name` for anything but a number (NaN passes: the
  caller's range check refuses it)."""
  if not is_real(value):
    raise ValueError(f"{name} must be a number, got {value!r} ({_type_name(value)})")
  return float(value)


def finite(name: str, value) -> float:
  value = real(name, value)
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  return value


def keyword_options(fn) -> list[str]:
  """The keyword options `fn` takes (its keyword parameters with defaults, sorted), or None
  when it takes any (`**kwargs`)."""
  params = inspect.signature(fn).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return None
  return sorted(p.name for p in params if p.default is not inspect.Parameter.empty)


def known_options(what: str, options, accepted) -> None:
  """ValueError naming the options of `options` (names) that are not in `accepted`, and listing
  the accepted ones: a misspelt option must not be dropped, nor fail as a bare TypeError."""
  unknown = sorted(set(options) - set(accepted))
  if unknown:
    raise ValueError(f"{what} has no option{'s' * (len(unknown) > 1)} "
                     f"{', '.join(map(repr, unknown))}; its options: {sorted(accepted)}")
