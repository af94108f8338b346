"""Loading experiment configs (`configs/<name>.py` exposing `get_config()`) and CLI overrides.

Overrides are `dotted.path=value` strings applied to nested frozen dataclasses, e.g.
`--set optim.total_steps=100 --set model.num_layers=2`. Values are parsed by the field's type.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import types
import typing
from typing import Any, Sequence


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> Any:
  """`configs/foo.py`, `configs.foo` or `foo` -> `get_config()` with overrides applied."""
  if name_or_path.endswith(".py") or os.path.sep in name_or_path:
    if not os.path.exists(name_or_path):
      raise ValueError(f"config file {name_or_path} does not exist")
    spec = importlib.util.spec_from_file_location("_specjax_config", name_or_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    module = importlib.import_module(name_or_path if "." in name_or_path
                                     else f"configs.{name_or_path}")
  if not hasattr(module, "get_config"):
    raise ValueError(f"config {name_or_path} has no get_config()")
  return apply_overrides(module.get_config(), overrides)


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
  """Applies all overrides at once, so no intermediate config has to be valid on its own."""
  tree: dict[str, Any] = {}
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"override {item!r} is not of the form dotted.path=value")
    path, value = item.split("=", 1)
    *parents, leaf = path.split(".")
    node = tree
    for name in parents:
      node = node.setdefault(name, {})
      if not isinstance(node, dict):
        raise ValueError(f"override {item!r} conflicts with another override of {name}")
    node[leaf] = value
  return _apply(cfg, tree, "")


def _apply(obj: Any, changes: dict[str, Any], prefix: str) -> Any:
  if not dataclasses.is_dataclass(obj):
    raise ValueError(f"cannot override {prefix or 'config'}: {type(obj).__name__} is not a config")
  fields = {f.name for f in dataclasses.fields(obj)}
  hints = typing.get_type_hints(type(obj))
  updates = {}
  for name, value in changes.items():
    if name not in fields:
      raise ValueError(f"{type(obj).__name__} has no field {prefix + name!r}; "
                       f"fields: {sorted(fields)}")
    if isinstance(value, dict):
      updates[name] = _apply(getattr(obj, name), value, f"{prefix}{name}.")
    else:
      updates[name] = _parse(value, hints.get(name, str), prefix + name)
  return dataclasses.replace(obj, **updates)


def _parse(raw: str, typ: Any, name: str) -> Any:
  options = typing.get_args(typ) if isinstance(typ, types.UnionType) or typing.get_origin(
      typ) is typing.Union else (typ,)
  if raw.lower() == "none" and type(None) in options:
    return None
  for t in options:
    if t is bool:
      if raw.lower() in ("true", "1", "yes"):
        return True
      if raw.lower() in ("false", "0", "no"):
        return False
    elif t in (int, float, str):
      try:
        return t(raw)
      except ValueError:
        continue
    elif typing.get_origin(t) is typing.Literal and raw in typing.get_args(t):
      return raw
    elif typing.get_origin(t) is tuple:
      return tuple(int(v) if v.strip().lstrip("-").isdigit() else v.strip()
                   for v in raw.split(",") if v.strip())
  raise ValueError(f"cannot parse {raw!r} for field {name} of type {typ}")
