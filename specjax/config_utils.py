"""Experiment configs: typed, validated dataclasses; loading (`configs/<name>.py` exposing
`get_config()`); CLI overrides; the fields listed for `--help`; and the one JSON form of a config.

Every config is a frozen dataclass declared with `@config`. Its fields carry types and ranges,
`num_prompts: PosInt = 8`, `top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0`,
`source: Literal["corpus", "self_distill"]`, and pydantic checks them whenever a config is made,
`dataclasses.replace` included, so no config holds a value its fields refuse. The check is
strict: "64" is not an int, 2.0 is not a layer count, `True` is not a number, and floats are
finite. A wrong field raises `ConfigError` (a ValueError) naming the class, the field, the value
and what the field takes.

Why pydantic: it validates plain dataclasses against their type hints and the annotated-types
constraints beside them, strictly, and says which field failed and why. The configs stay
ordinary frozen dataclasses (`dataclasses.fields`, `replace`, hashing for static jit
arguments), and `configs/<name>.py` keeps building them in Python. Of the alternatives,
ml_collections' ConfigDicts are untyped, fiddle configures call graphs rather than typed
records, and tyro generates a command line whose syntax would replace the documented `--set`.

Overrides are `dotted.path=value` strings applied to nested configs, e.g.
`--set optim.total_steps=100 --set model.num_layers=2`. Each value is read as its field's type,
range included: `--set num_prompts=-1` names the field and its range.

`to_dict` / `from_dict` turn a config dataclass into JSON-ready dicts and back (run configs,
training metadata, benchmark results, drafter folders), so every file that records a config
records it the same way and every reader rebuilds it the same way, with the same checks.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

import annotated_types
import pydantic
import typing_extensions
from annotated_types import Ge, Gt, Interval, Le, Lt, MinLen

__all__ = ["ConfigError", "Fraction", "Ge", "Gt", "Interval", "Le", "Lt", "MinLen", "NonEmpty",
           "NonEmptyStr", "NonNegFloat", "NonNegInt", "PosFloat", "PosInt", "Seed", "config"]

# -- typed configs ---------------------------------------------------------------------------

PosInt = Annotated[int, Ge(1)]
NonNegInt = Annotated[int, Ge(0)]
PosFloat = Annotated[float, Gt(0)]
NonNegFloat = Annotated[float, Ge(0)]
Fraction = Annotated[float, Interval(ge=0, le=1)]
Seed = Annotated[int, Interval(ge=0, lt=2**32)]  # what jax.random.key takes without aliasing
NonEmpty = MinLen(1)  # Annotated[tuple[str, ...], NonEmpty]: at least one item
NonEmptyStr = Annotated[str, MinLen(1)]

# Strict types, no fields beyond the declared ones, finite floats. `arbitrary_types_allowed`
# admits fields of types pydantic has no schema for (checked as isinstance).
_RULES = pydantic.ConfigDict(strict=True, extra="forbid", allow_inf_nan=False,
                             arbitrary_types_allowed=True)


class ConfigError(ValueError):
  """A config field holds a value its type or range refuses (or the fields disagree)."""


def config(cls: type) -> type:
  """Declares `cls` a config: a frozen dataclass whose fields pydantic checks at every
  construction (`dataclasses.replace` too) against their types and ranges, then `__post_init__`
  for what relates several fields. Failures raise `ConfigError` naming the field."""
  cls = pydantic.dataclasses.dataclass(frozen=True, config=_RULES)(cls)
  validated_init = cls.__init__
  hints = typing.get_type_hints(cls)
  tuples = {n for n, t in hints.items()
            if any(typing.get_origin(o) is tuple for o in _union_options(t))}

  @functools.wraps(validated_init)
  def __init__(self, *args, **kwargs):
    # A list where a tuple is declared is taken as that tuple (tuples keep configs hashable).
    kwargs = {k: tuple(v) if k in tuples and isinstance(v, list) else v
              for k, v in kwargs.items()}
    try:
      validated_init(self, *args, **kwargs)
    except pydantic.ValidationError as e:
      raise ConfigError(explain(e, type(self))) from None

  cls.__init__ = __init__
  return cls


# pydantic error types -> what the field takes, in the library's words.
_TAKES = {
    "int_type": "an int", "int_parsing": "an int", "int_from_float": "an int",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
    "tuple_type": "a tuple", "list_type": "a list", "dict_type": "a mapping",
    "none_required": "none",
}


def requirement(err: dict[str, Any], typ: Any = None) -> str:
  """What the field takes, from pydantic's error `err` (and the field's type, whose full range
  a range error then quotes)."""
  kind, ctx = err["type"], err.get("ctx") or {}
  if kind in _TAKES:
    return f"must be {_TAKES[kind]}"
  if kind.startswith(("greater_than", "less_than")):
    if typ is not None:
      return f"must be {_article(type_name(typ))}"
    name, op = next((n, o) for n, o in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                    if n in ctx)
    return f"must be {op} {ctx[name]}"
  if kind == "literal_error":
    return f"must be one of {ctx.get('expected')}"
  if kind == "string_too_short":
    return "must not be empty"
  if kind == "too_short":
    return f"must hold at least {ctx.get('min_length')} item(s)"
  if kind in ("dataclass_exact_type", "dataclass_type", "is_instance_of"):
    return f"must be a {ctx.get('class_name') or ctx.get('class') or 'config'}"
  return err["msg"][:1].lower() + err["msg"][1:]


def _article(name: str) -> str:
  return ("an " if name[:1] in "aeiou" else "a ") + name


def location(loc: Sequence[Any]) -> str:
  """A pydantic error's location as the field's path: ("budget_nodes", 1) -> budget_nodes[1]."""
  return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def explain(e: pydantic.ValidationError, owner: type | str) -> str:
  """The failed fields of config class `owner`, one clause each:
  `Owner.field must be ..., got x`."""
  name = owner if isinstance(owner, str) else owner.__name__
  hints = {} if isinstance(owner, str) else typing.get_type_hints(owner, include_extras=True)
  lines = []
  for err in e.errors(include_url=False):
    loc = location(err["loc"])
    if err["type"] == "value_error":  # raised by __post_init__: its own message
      lines.append(f"{name}: {err.get('ctx', {}).get('error', err['msg'])}")
    elif err["type"] == "unexpected_keyword_argument":
      lines.append(_no_field(owner, loc, loc) if not isinstance(owner, str) else
                   f"{name} has no field {loc!r}; fields: (see the class)")
    elif err["type"] == "missing_argument":
      lines.append(f"{name}.{loc} is required")
    else:
      typ = _type_at(hints, err["loc"])
      lines.append(f"{name}.{loc} {requirement(err, typ)}, got {err.get('input')!r}")
  # A failed item of a tuple can also fail the tuple's length check "after validation".
  lines = list(dict.fromkeys(lines))
  return "; ".join(lines[:1] + [x for x in lines[1:] if "item(s)" not in x])


def _type_at(hints: dict[str, Any], loc: tuple) -> Any:
  """The declared type at an error's location: a field, a tuple's item, a dict's value."""
  if not loc or loc[0] not in hints:
    return None
  typ = hints[loc[0]]
  for part in loc[1:]:
    base = _strip(typ)
    args = typing.get_args(base)
    if typing.get_origin(base) is tuple and isinstance(part, int) and args:
      typ = args[0] if len(args) == 2 and args[1] is Ellipsis else args[min(part, len(args) - 1)]
    elif typing.get_origin(base) is dict and len(args) == 2:
      typ = args[1]
    else:
      return None
  return typ


# -- loading and overrides -------------------------------------------------------------------


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> Any:
  """`configs/foo.py`, `configs.foo` or `foo` -> `get_config()` with overrides applied.
  A config file that does not import, has no `get_config`, fails in it or returns no config
  dataclass raises ValueError naming the file."""
  try:
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
    cfg = module.get_config()
  except (ValueError, ModuleNotFoundError):
    raise
  except Exception as e:  # a config file is code: its own errors are named with it
    raise ValueError(f"config {name_or_path} failed to load: {type(e).__name__}: {e}") from e
  if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
    raise ValueError(f"get_config() of {name_or_path} returned a {type(cfg).__name__}, not a "
                     "config dataclass")
  return apply_overrides(cfg, overrides)


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
  hints = typing.get_type_hints(type(obj), include_extras=True)
  updates = {}
  for name, value in changes.items():
    if name not in fields:
      item = value.item if isinstance(value, _Leaf) else _items(value)[0]
      raise ValueError(f"override {item!r}: {_no_field(type(obj), name, prefix + name)}")
    current = getattr(obj, name)
    if isinstance(value, _Leaf) and dataclasses.is_dataclass(current):
      fields_of = sorted(f.name for f in dataclasses.fields(current))
      raise ConfigError(f"override {value.item!r}: {prefix}{name} is a config: set its fields "
                        f"one by one ({prefix}{name}.<field>=...; fields: {fields_of})")
    if isinstance(value, dict) and isinstance(current, Mapping):
      updates[name] = _apply_mapping(current, value, hints.get(name), f"{prefix}{name}.")
    elif isinstance(value, dict):
      updates[name] = _apply(current, value, f"{prefix}{name}.")
    else:
      updates[name] = parse_value(value.raw, hints.get(name, str), item=value.item,
                                  field=prefix + name)
  try:
    return dataclasses.replace(obj, **updates)
  except ValueError as e:  # the fields disagree with each other (`__post_init__`)
    raise ConfigError(f"override {', '.join(map(repr, _items(changes)))}: {e}") from None


def _no_field(cls: type, name: str, shown: str) -> str:
  """The refusal of a field `name` (`shown` as the override spells it) that config class `cls`
  lacks: its fields, or the class's own word on it where it has one (`why_no_field(name)`, e.g.
  a drafter family's options saying which families have that option)."""
  why = getattr(cls, "why_no_field", None)
  if callable(why):
    return why(name)
  return (f"{cls.__name__} has no field {shown!r}; fields: "
          f"{sorted(f.name for f in dataclasses.fields(cls))}")


def _apply_mapping(current: Mapping[str, Any], changes: dict[str, Any], typ: Any, prefix: str
                   ) -> dict[str, Any]:
  """A dict-valued field (`dict[str, T]`): `field.key=value` sets one entry, parsed as T."""
  args = typing.get_args(_strip(typ))
  value_type = args[1] if len(args) == 2 else str
  out = dict(current)
  for key, value in changes.items():
    if isinstance(value, dict):
      raise ValueError(f"override {_items(value)[0]!r}: {prefix}{key} is one entry, not a config")
    out[key] = parse_value(value.raw, value_type, item=value.item, field=prefix + key)
  return out


_UNTYPED = object()
_NONE_WORDS = ("none", "null")


def _strip(typ: Any) -> Any:
  """`Annotated[T, ...]` (or a TypedDict's `Required[T]`) -> T."""
  while typing.get_origin(typ) in (Annotated, typing_extensions.Required,
                                   typing_extensions.NotRequired):
    typ = typing.get_args(typ)[0]
  return typ


def _union_options(typ: Any) -> tuple[Any, ...]:
  base = _strip(typ)
  if isinstance(base, types.UnionType) or typing.get_origin(base) is typing.Union:
    return typing.get_args(base)
  return (typ,)


@functools.cache
def _adapter(typ: Any) -> pydantic.TypeAdapter:
  return pydantic.TypeAdapter(typ, config=pydantic.ConfigDict(allow_inf_nan=False))


def parse_value(raw: str, typ: Any = _UNTYPED, *, item: str | None = None,
                field: str | None = None) -> Any:
  """The value of the text `raw` for a field of type `typ`, its range checked: bool
  (true/false, yes/no, 1/0), int, float, str, Literal choices, tuples (comma-separated items,
  each read as the item type) and unions of them with None ("none"). Untyped (no `typ`): a
  Python literal if `raw` is one (`4` -> 4, `[[0], [0, 0]]` -> a list), else the text itself
  (`tree8`), as drafter options need. A refused value raises ConfigError naming `item` (the
  override it came from) and `field`."""
  if typ is _UNTYPED:
    try:
      return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
      return raw
  field = field or (item.partition("=")[0] if item else None)
  text = raw.strip()
  options = _union_options(typ)
  if text.lower() in _NONE_WORDS and type(None) in options:
    return None
  reasons = []
  kinds = [t for t in options if t is not type(None)]
  for t in kinds:
    try:
      if typing.get_origin(_strip(t)) is tuple:
        return _parse_tuple(text, t, item=item, field=field)
      return _adapter(t).validate_strings(text)
    except pydantic.ValidationError as e:
      reasons.append(requirement(e.errors()[0], t))
    except ConfigError:
      if len(kinds) == 1:  # the one type a value can have: its own, finer message
        raise
      reasons.append("")
  reason = reasons[0] if len(reasons) == 1 else f"must be {type_name(typ)}"
  raise _refused(item, field, f"{reason}, got {raw!r}")


def _refused(item: str | None, field: str | None, what: str) -> ConfigError:
  """The error for a `--set` value: `override 'item': field <what>`."""
  where = f"override {item!r}: " if item is not None else ""
  return ConfigError(f"{where}{field or 'the value'} {what}")


def _parse_tuple(text: str, typ: Any, *, item: str | None, field: str | None) -> tuple:
  base = _strip(typ)
  args = typing.get_args(base)
  parts = [p.strip() for p in text.split(",")] if text else []
  if parts and not all(parts):
    raise _refused(item, field, f"is a comma-separated list without empty items, got {text!r}")
  if len(args) == 2 and args[1] is Ellipsis:
    kinds = [args[0]] * len(parts)
  else:
    kinds = list(args)
    if len(kinds) != len(parts):
      raise _refused(item, field, f"takes {len(kinds)} comma-separated items, got {text!r}")
  value = tuple(parse_value(p, k, item=item, field=f"{field or 'the value'}[{i}]")
                for i, (p, k) in enumerate(zip(parts, kinds)))
  try:
    return _adapter(typ).validate_python(value)
  except pydantic.ValidationError as e:
    raise _refused(item, field, f"{requirement(e.errors()[0], typ)}, got {text!r}") from None


def type_name(typ: Any) -> str:
  """A field's type as `--help` and errors word it: `int >= 1`, `'a' | 'b'`, `list of float`,
  `str or none`."""
  while typing.get_origin(typ) in (typing_extensions.Required, typing_extensions.NotRequired):
    typ = typing.get_args(typ)[0]
  options = _union_options(typ)
  if len(options) > 1:
    names = [type_name(t) for t in options if t is not type(None)]
    return " or ".join(names) + (" or none" if type(None) in options else "")
  base, constraints = _strip(typ), typing.get_args(typ)[1:] if typing.get_origin(
      typ) is Annotated else ()
  origin, args = typing.get_origin(base), typing.get_args(base)
  if origin is typing.Literal:
    name = " | ".join(repr(a) for a in args)
  elif origin is list:
    name = "list of " + type_name(args[0]) if args else "list"
  elif origin is tuple:
    name = ("list of " + type_name(args[0]) if len(args) == 2 and args[1] is Ellipsis
            else "list of " + ", ".join(type_name(a) for a in args))
    least = next((c.min_length for c in constraints if isinstance(c, MinLen)), 0)
    name += f" (at least {least})" if least else ""
  elif origin is dict:
    name = f"{type_name(args[0])} -> {type_name(args[1])} entries" if args else "mapping"
  elif isinstance(base, type):
    name = base.__name__
  else:
    name = str(base).replace("typing.", "")
  return " ".join([name, *filter(None, (_constraint_text(c) for c in constraints))])


def _constraint_text(c: Any) -> str:
  if isinstance(c, annotated_types.Interval):
    lo = f"[{c.ge}" if c.ge is not None else f"({c.gt}" if c.gt is not None else "(-inf"
    hi = f"{c.le}]" if c.le is not None else f"{c.lt})" if c.lt is not None else "inf)"
    return f"in {lo}, {hi}"
  for cls, op, attr in ((Ge, ">=", "ge"), (Gt, ">", "gt"), (Le, "<=", "le"), (Lt, "<", "lt")):
    if isinstance(c, cls):
      return f"{op} {getattr(c, attr)}"
  return ""


def describe_fields(cfg: Any, prefix: str = "") -> list[str]:
  """`name: type = value` for every field of config `cfg` (an instance: its values; a class: its
  defaults), nested configs flattened to dotted names, each followed by its comment in the
  source (indented lines): what `--help` lists."""
  cls = cfg if isinstance(cfg, type) else type(cfg)
  hints = typing.get_type_hints(cls, include_extras=True)
  notes = field_notes(cls)
  lines = []
  for f in dataclasses.fields(cls):
    if isinstance(cfg, type):
      value = f.default if f.default is not dataclasses.MISSING else (
          f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
      required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    else:
      value, required = getattr(cfg, f.name), False
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      lines += describe_fields(value, f"{prefix}{f.name}.")
      continue
    hint = _strip(hints.get(f.name))
    if required and isinstance(hint, type) and dataclasses.is_dataclass(hint):
      lines += describe_fields(hint, f"{prefix}{f.name}.")  # its class's defaults
      continue
    shown = "(required)" if required else f"= {_show(value)}"
    lines.append(f"{prefix}{f.name}: {type_name(hints.get(f.name, Any))} {shown}")
    if notes.get(f.name):
      lines += textwrap.wrap(notes[f.name], width=96, initial_indent="    ",
                             subsequent_indent="    ")
  return lines


@functools.cache
def field_notes(cls: type) -> dict[str, str]:
  """The comment beside each field in `cls`'s source (the one on its line, else the lines just
  above it), as `--help` shows them; {} where the source cannot be read (a notebook cell)."""
  import inspect
  import io
  import tokenize
  notes: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    if not dataclasses.is_dataclass(klass):
      continue
    try:
      source = inspect.getsource(klass)
    except (OSError, TypeError):
      continue
    fields = {f.name for f in dataclasses.fields(klass)}
    above: list[str] = []
    line_names: dict[int, str] = {}
    try:
      tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
      continue
    for i, tok in enumerate(tokens):
      if tok.type == tokenize.COMMENT:
        text = tok.string.lstrip("#").strip()
        owner = line_names.get(tok.start[0])
        if owner is not None:
          notes[owner] = text
        else:
          above.append(text)
      elif tok.type == tokenize.NAME and tok.start[1] == 2 and tok.string in fields and (
          i + 1 < len(tokens) and tokens[i + 1].string == ":"):
        line_names[tok.start[0]] = tok.string
        if above:
          notes[tok.string] = " ".join(above)
        above = []
      elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.COMMENT) and tok.start[0] not in line_names:
        above = []
  return notes


def _show(value: Any) -> str:
  if value is None:
    return "none"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, tuple):
    return ",".join(map(str, value)) if value else "(empty)"
  return str(value) if not isinstance(value, str) or value else "''"


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
              codecs: Mapping[type, Codec] | None = None, where: str | None = None) -> Any:
  """Rebuilds dataclass `cls` from `to_dict`'s form, by its type hints: nested dataclasses,
  tuples (from lists), Optional fields and `codecs`' types, each field checked as the config
  checks it (a class's `record_types(d)` types the fields whose type depends on the record).
  Missing fields take their defaults; unknown keys raise ValueError, or with
  `strict=False` are ignored (metadata written by an older or newer version). `where` (the file
  it was read from) prefixes any error."""
  if where is not None:
    try:
      return from_dict(cls, d, strict=strict, codecs=codecs)
    except ValueError as e:
      raise ConfigError(f"{where}: {e}") from None
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
  # A field whose type depends on the record (a drafter trainer's `family`, its method's options
  # class) is typed by the class itself: `record_types(d) -> {field: type}`.
  typed = getattr(cls, "record_types", None)
  if callable(typed):
    hints = {**hints, **typed(d)}
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
