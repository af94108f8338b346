"""Property tests of the typed configs (`specjax.config_utils`): whatever value a field is given,
through `--set` text, from Python or from a JSON file, the config either holds it or refuses it
with a `ConfigError` that names the field. Never a TypeError, an AttributeError or a traceback
from inside pydantic or a `__post_init__`.

The configs are the shipped ones (`configs/*.py`), so every field a user can reach is drawn.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax import config_utils
from specjax.config_utils import ConfigError, apply_overrides, from_dict, load_config, to_dict

CONFIGS = ("benchmark", "reproduce", "eagle_stdlib", "dflash_stdlib", "medusa_stdlib",
           "target_stdlib")
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _leaf_paths(cfg, prefix=""):
  """Every field a `--set` can reach, nested configs by dotted path."""
  out = []
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if dataclasses.is_dataclass(value):
      out += _leaf_paths(value, f"{prefix}{f.name}.")
    else:
      out.append(f"{prefix}{f.name}")
  return out


_CFGS = {name: load_config(f"configs/{name}.py") for name in CONFIGS}
_PATHS = [(name, path) for name, cfg in _CFGS.items() for path in _leaf_paths(cfg)]

# Text a user might type: numbers of every kind, words the parser knows, lists, and junk.
_TEXT = st.one_of(
    st.integers(-2**40, 2**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "none", "None", "null", "true", "false", "yes", "0", "1", "-1",
                     "1,2", "1,,2", "a,b", ",", "nan", "inf", "-inf", "1e309", "0x10", "1_000",
                     "[1, 2]", "{}", "dp=2,tp=4", "auto", "float32", "bfloat16", "'x'"]),
    st.lists(st.integers(-5, 70).map(str), min_size=1, max_size=4).map(",".join),
    st.text(max_size=12),
)

# Python values of the wrong type as often as of the right one.
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(-3, 9), max_size=3), st.tuples(st.integers(-3, 9)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(object()),
)


def _field_named(message: str, path: str) -> bool:
  leaf = path.rsplit(".", 1)[-1]
  return leaf in message


@SETTINGS
@given(where=st.sampled_from(_PATHS), text=_TEXT)
def test_any_set_text_is_taken_or_refused_naming_the_field(where, text):
  name, path = where
  item = f"{path}={text}"
  try:
    cfg = apply_overrides(_CFGS[name], [item])
  except ConfigError as e:
    assert _field_named(str(e), path), (item, str(e))
    assert "\n" not in str(e)  # one line: the CLI prints it as `error: ...`
    return
  value = cfg
  for part in path.split("."):
    value = getattr(value, part)
  if isinstance(value, float) and not math.isnan(value):
    assert math.isfinite(value)  # configs hold finite floats only


@SETTINGS
@given(where=st.sampled_from(_PATHS), value=_VALUES)
def test_any_python_value_is_taken_or_refused_naming_the_field(where, value):
  name, path = where
  *parents, leaf = path.split(".")
  chain = [_CFGS[name]]
  for part in parents:
    chain.append(getattr(chain[-1], part))
  try:
    new = dataclasses.replace(chain[-1], **{leaf: value})
    for outer, part in zip(reversed(chain[:-1]), reversed(parents)):
      new = dataclasses.replace(outer, **{part: new})
  except ConfigError as e:
    assert _field_named(str(e), path), (path, value, str(e))
    return
  held = new
  for part in path.split("."):
    held = getattr(held, part)
  # Taken as given (a list where a tuple is declared becomes that tuple; an int a float).
  if isinstance(value, list):
    assert held == tuple(value)
  elif isinstance(value, int) and not isinstance(value, bool) and isinstance(held, float):
    assert held == float(value)
  else:
    assert held == value or held is value


@SETTINGS
@given(where=st.sampled_from([(n, p) for n, p in _PATHS if "." not in p]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                       st.lists(st.integers(-3, 9), max_size=3),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_any_json_value_is_read_back_or_refused_naming_the_file_and_field(where, value):
  """A results or metadata file whose field was edited by hand: `from_dict` with `where`."""
  name, path = where
  cfg = _CFGS[name]
  d = json.loads(json.dumps(to_dict(cfg)))
  d[path] = value
  try:
    back = from_dict(type(cfg), d, where="metadata.json")
  except ValueError as e:
    assert str(e).startswith("metadata.json: ") and _field_named(str(e), path), (path, str(e))
    return
  assert dataclasses.is_dataclass(back)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_field_has_a_type_and_help_lists_it(name):
  """`--help` lists every field with its type; the numeric ones carry a range."""
  cfg = _CFGS[name]
  lines = config_utils.describe_fields(cfg)
  listed = [line.split(":")[0] for line in lines if not line.startswith(" ")]
  assert listed == _leaf_paths(cfg)
  for line in lines:
    if line.startswith(" "):
      continue
    field, kind = line.split(": ", 1)
    assert kind and " = " in kind or "(required)" in kind, line
    if kind.startswith(("int ", "float ")) and not field.endswith(("seed",)):
      assert any(op in kind for op in (">=", ">", " in ")), line  # a range
