"""Experiment configs: loading (`configs/<name>.py` exposing `get_config()`), CLI overrides and
the one JSON form of a config.

Overrides are `dotted.path=value` strings applied to nested frozen dataclasses, e.g.
`--set optim.total_steps=100 --set model.num_layers=2`. Values are parsed by the field's type.

`to_dict` / `from_dict` turn a config dataclass into JSON-ready dicts and back (run configs,
training metadata, benchmark results, drafter folders), so every file that records a config
records it the same way and every reader rebuilds it the same way.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any


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
    current = getattr(obj, name)
    if isinstance(value, dict) and isinstance(current, Mapping):
      updates[name] = _apply_mapping(current, value, hints.get(name), f"{prefix}{name}.")
    elif isinstance(value, dict):
      updates[name] = _apply(current, value, f"{prefix}{name}.")
    else:
      updates[name] = parse_value(value.raw, hints.get(name, str), item=value.item)
  return dataclasses.replace(obj, **updates)


def _apply_mapping(current: Mapping[str, Any], changes: dict[str, Any], typ: Any, prefix: str
                   ) -> dict[str, Any]:
  """A dict-valued field (`dict[str, T]`): `field.key=value` sets one entry, parsed as T."""
  args = typing.get_args(typ)
  value_type = args[1] if len(args) == 2 else str
  out = dict(current)
  for key, value in changes.items():
    if isinstance(value, dict):
      raise ValueError(f"override {_items(value)[0]!r}: {prefix}{key} is one entry, not a config")
    out[key] = parse_value(value.raw, value_type, item=value.item)
  return out


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


# -- JSON form -------------------------------------------------------------------------------

# A type's own JSON form: (encode: value -> JSON-ready, decode: JSON value -> value).
Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]


def hf_codecs(*classes: type) -> dict[type, Codec]:
  """Codecs storing each class as its Hugging Face dict (`to_hf_dict` / `from_hf_dict`): the
  form drafter folders store their network's `model` in."""
  return {c: (c.to_hf_dict, c.from_hf_dict) for c in classes}


def to_dict(obj: Any, *, codecs: Mapping[type, Codec] | None = None,
            strings: Callable[[str], str] | None = None) -> Any:
  """JSON-ready copy of `obj`: a dataclass becomes a dict of its fields (in order), nested ones
  too; tuples become lists; dict keys become strings as JSON writes them; a value of a type in
  `codecs` becomes its encoding. `strings` maps every string (e.g. to portable paths). Any other
  object becomes `str(obj)`, as `json.dumps(default=str)` wrote it."""
  def conv(v):
    if codecs:
      for t, (encode, _) in codecs.items():
        if isinstance(v, t):
          return conv(encode(v))
    if v is None or isinstance(v, bool):
      return v
    if isinstance(v, int):
      return int(v)
    if isinstance(v, float):
      return float(v)
    if isinstance(v, str):
      return strings(v) if strings else v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
      return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
      return {k if isinstance(k, str) else json.dumps(k): conv(w) for k, w in v.items()}
    if isinstance(v, (list, tuple)):
      return [conv(w) for w in v]
    return conv(str(v))

  return conv(obj)


def from_dict(cls: type, d: Mapping[str, Any], *, strict: bool = True,
              codecs: Mapping[type, Codec] | None = None) -> Any:
  """Rebuilds dataclass `cls` from `to_dict`'s form, by its type hints: nested dataclasses,
  tuples (from lists), Optional fields and `codecs`' types. Missing fields take their defaults;
  unknown keys raise ValueError, or with `strict=False` are ignored (metadata written by an
  older or newer version)."""
  name = cls.__name__
  if not isinstance(d, Mapping):
    raise ValueError(f"{name} is stored as a dict of its fields, got {type(d).__name__}")
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(d) - set(fields))
  if strict and unknown:
    raise ValueError(f"{name} has no field(s) {unknown}; fields: {sorted(fields)}")
  missing = [n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ValueError(f"{name} needs field(s) {missing}")
  hints = typing.get_type_hints(cls)
  return cls(**{n: _decode(d[n], hints.get(n, Any), f"{name}.{n}", strict, codecs or {})
                for n in fields if n in d})


def _decode(v: Any, typ: Any, where: str, strict: bool, codecs: Mapping[type, Codec]) -> Any:
  origin, args = typing.get_origin(typ), typing.get_args(typ)
  if origin is typing.Union or isinstance(typ, types.UnionType):
    if v is None:
      return None
    options = [t for t in args if t is not type(None)]
    # The option whose JSON shape `v` has: a dict for a config, a list for a tuple.
    for t in options:
      if (isinstance(v, Mapping) and (t in codecs or dataclasses.is_dataclass(t))) or (
          isinstance(v, list) and typing.get_origin(t) in (tuple, list)):
        return _decode(v, t, where, strict, codecs)
    return v
  if typ in codecs:
    return codecs[typ][1](v)
  if dataclasses.is_dataclass(typ):
    return from_dict(typ, v, strict=strict, codecs=codecs)
  if origin in (tuple, list):
    if not isinstance(v, (list, tuple)):
      raise ValueError(f"{where} is stored as a list, got {v!r}")
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
      return tuple(_decode(x, t, where, strict, codecs) for x, t in zip(v, args)) if args else (
          tuple(v))
    item = args[0] if args else Any
    return origin(_decode(x, item, where, strict, codecs) for x in v)
  if origin is dict and args and isinstance(v, Mapping):
    return {k: _decode(x, args[1], where, strict, codecs) for k, x in v.items()}
  return v


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested dict's leaves by dotted key: {"optim": {"b1": 0.9}} -> {"optim.b1": 0.9}."""
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def read_json_object(file: str | os.PathLike) -> dict[str, Any] | None:
  """A JSON file holding one object (the optional metadata files beside a checkpoint), None when
  the file does not exist; ValueError naming the file when it is not a JSON object."""
  file = os.fspath(file)
  if not os.path.isfile(file):
    return None
  with open(file) as f:
    try:
      d = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(d, dict):
    raise ValueError(f"{file} must hold a JSON object")
  return d
