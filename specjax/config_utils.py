"""Loading experiment configs (`configs/<name>.py` exposing `get_config()`) and CLI overrides.

Overrides are `dotted.path=value` strings applied to nested frozen dataclasses, e.g.
`--set optim.total_steps=100 --set model.num_layers=2`. Values are parsed by the field's type.
"""

from __future__ import annotations

import ast
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


def parse_assignment(item: str, what: str = "override", form: str = "dotted.path=value"
                     ) -> tuple[str, str]:
  """`dotted.path=value` -> (path, raw value text): the one syntax of `--set` items and of the
  benchmark's drafter options (`what` and `form` word the error)."""
  path, sep, raw = item.partition("=")
  if not sep or not path or not all(path.split(".")):
    raise ValueError(f"{what} {item!r} is not of the form {form}")
  return path, raw


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
  """Applies all overrides at once, so no intermediate config has to be valid on its own."""
  tree: dict[str, Any] = {}
  for item in overrides:
    path, raw = parse_assignment(item)
    *parents, leaf = path.split(".")
    node = tree
    for name in parents:
      node = node.setdefault(name, {})
      if not isinstance(node, dict):
        raise ValueError(f"override {item!r} conflicts with another override of {name}")
    if isinstance(node.get(leaf), dict):
      raise ValueError(f"override {item!r} conflicts with another override of {leaf}")
    node[leaf] = _Leaf(raw, item)
  return _apply(cfg, tree, "")


@dataclasses.dataclass(frozen=True)
class _Leaf:
  raw: str
  item: str  # the override it came from, for error messages


def _items(tree: dict[str, Any]) -> list[str]:
  return [v.item for v in tree.values() if isinstance(v, _Leaf)] + [
      i for v in tree.values() if isinstance(v, dict) for i in _items(v)]


def _apply(obj: Any, changes: dict[str, Any], prefix: str) -> Any:
  if not dataclasses.is_dataclass(obj):
    raise ValueError(f"override {_items(changes)[0]!r}: {prefix.rstrip('.')} is not a config "
                     f"(it is a {type(obj).__name__} value)")
  fields = {f.name for f in dataclasses.fields(obj)}
  hints = typing.get_type_hints(type(obj))
  updates = {}
  for name, value in changes.items():
    if name not in fields:
      item = value.item if isinstance(value, _Leaf) else _items(value)[0]
      raise ValueError(f"override {item!r}: {type(obj).__name__} has no field "
                       f"{prefix + name!r}; fields: {sorted(fields)}")
    if isinstance(value, dict):
      updates[name] = _apply(getattr(obj, name), value, f"{prefix}{name}.")
    else:
      updates[name] = parse_value(value.raw, hints.get(name, str), item=value.item)
  return dataclasses.replace(obj, **updates)


_UNTYPED = object()


def parse_value(raw: str, typ: Any = _UNTYPED, *, item: str | None = None) -> Any:
  """The value of `raw` for a field of type `typ` (bool, int, float, str, Literal, tuple, and
  unions of them with None). Untyped (no `typ`): a Python literal if `raw` is one (`4` -> 4,
  `[[0], [0, 0]]` -> a list), else the text itself (`tree8`), as drafter options need."""
  if typ is _UNTYPED:
    try:
      return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      return raw
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
  where = f"override {item!r}: " if item is not None else ""
  raise ValueError(f"{where}cannot parse {raw!r} as {_type_name(typ)}")


def _type_name(typ: Any) -> str:
  return typ.__name__ if isinstance(typ, type) else str(typ).replace("typing.", "")

