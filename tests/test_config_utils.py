"""`specjax.config_utils`: overrides (`--set`, drafter options) and the JSON form of configs.

Every config file the project writes (run_config.json, metadata.json, results.json, drafter
folders) goes through `to_dict` and is read back by `from_dict`, so these round trips are what
keeps old folders readable.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from specjax.config_utils import (
  apply_overrides,
  from_dict,
  hf_codecs,
  parse_assignment,
  parse_value,
  to_dict,
)
from specjax.lab.benchmark import BenchmarkConfig
from specjax.models.config import ModelConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class Inner:
  rate: float = 0.5
  name: str = "a"


@dataclasses.dataclass(frozen=True)
class Outer:
  steps: int
  inner: Inner = Inner()
  maybe_inner: Inner | None = None
  layers: tuple[int, ...] = (1, 2)
  maybe_layers: tuple[int, ...] | None = None
  pairs: tuple[tuple[int, int], ...] = ()
  path: str | None = None
  flag: bool = False


@dataclasses.dataclass(frozen=True)
class WithModel:
  model: ModelConfig
  depth: int = 3


def _json_round_trip(d):
  return json.loads(json.dumps(d, allow_nan=False))


@pytest.mark.parametrize("cfg", [
    Outer(steps=3),
    Outer(steps=3, inner=Inner(0.25, "b"), maybe_inner=Inner(), layers=(4,),
          maybe_layers=(0, 5), pairs=((1, 2), (3, 4)), path="/x", flag=True),
], ids=["defaults", "every_field_set"])
def test_round_trip_nested_tuple_optional(cfg):
  d = _json_round_trip(to_dict(cfg))
  assert d["layers"] == list(cfg.layers)  # tuples are JSON lists
  back = from_dict(Outer, d)
  assert back == cfg and isinstance(back.layers, tuple) and isinstance(back.inner, Inner)
  assert back.pairs == cfg.pairs and all(isinstance(p, tuple) for p in back.pairs)


def test_to_dict_matches_the_json_the_project_wrote_before():
  """asdict + json default=str, the old form of run_config.json and metadata: byte-identical."""
  cfg = WithModel(ModelConfig(vocab_size=64, eos_token_id=(0, 1),
                              rope_scaling=RopeScaling("linear", factor=2.0)))
  old = json.dumps(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), indent=1)
  assert json.dumps(to_dict(cfg), indent=1) == old
  assert from_dict(WithModel, _json_round_trip(to_dict(cfg))) == cfg


def test_strings_are_mapped_everywhere():
  cfg = Outer(steps=1, inner=Inner(name="/abs/name"), path="/abs/path")
  d = to_dict(cfg, strings=str.upper)
  assert d["path"] == "/ABS/PATH" and d["inner"]["name"] == "/ABS/NAME"
  assert to_dict({"k": ("/a", 1)}, strings=str.upper) == {"k": ["/A", 1]}


def test_unknown_keys_strict_or_ignored():
  d = dict(to_dict(Outer(steps=2)), added_later=1)
  with pytest.raises(ValueError, match=r"Outer has no field\(s\) \['added_later'\]"):
    from_dict(Outer, d)
  assert from_dict(Outer, d, strict=False) == Outer(steps=2)
  nested = to_dict(Outer(steps=2))
  nested["inner"]["gone"] = 0
  with pytest.raises(ValueError, match=r"Inner has no field\(s\) \['gone'\]"):
    from_dict(Outer, nested)
  assert from_dict(Outer, nested, strict=False) == Outer(steps=2)


def test_missing_fields_take_defaults_or_are_named():
  assert from_dict(Outer, {"steps": 7}) == Outer(steps=7)
  with pytest.raises(ValueError, match=r"Outer needs field\(s\) \['steps'\]"):
    from_dict(Outer, {})


def test_model_config_as_hf_dict_round_trip():
  """Drafter folders store `net.model` as the HF config.json dict."""
  model = ModelConfig(architecture="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      eos_token_id=(0,), bos_token_id=0)
  codecs = hf_codecs(ModelConfig)
  d = _json_round_trip(to_dict(WithModel(model, depth=5), codecs=codecs))
  assert d == {"model": _json_round_trip(model.to_hf_dict()), "depth": 5}
  assert from_dict(WithModel, d, codecs=codecs) == WithModel(model, depth=5)


# -- overrides ------------------------------------------------------------------------------


def test_parse_assignment():
  assert parse_assignment("optim.total_steps=100") == ("optim.total_steps", "100")
  assert parse_assignment("a=b=c") == ("a", "b=c")
  for bad in ("noequals", "=1", "a..b=1", ".a=1"):
    with pytest.raises(ValueError, match=f"override '{bad}' is not of the form"):
      parse_assignment(bad)


def test_parse_value_untyped_is_a_literal_or_text():
  assert parse_value("4") == 4
  assert parse_value("tree8") == "tree8"
  assert parse_value("[[0],[0,0]]") == [[0], [0, 0]]
  assert parse_value("'x'") == "x"


def test_parse_value_typed():
  assert parse_value("3", int) == 3 and parse_value("0.5", float) == 0.5
  assert parse_value("true", bool) is True and parse_value("none", int | None) is None
  assert parse_value("3,6", tuple[int, ...]) == (3, 6)
  with pytest.raises(ValueError, match=r"override 'x=abc': x must be an int, got 'abc'"):
    parse_value("abc", int, item="x=abc")


@pytest.mark.parametrize("overrides,message", [
    (["steps=abc"], r"override 'steps=abc': steps must be an int, got 'abc'"),
    (["nosuchfield=1"], r"override 'nosuchfield=1': Outer has no field 'nosuchfield'"),
    (["inner.nope=1"], r"override 'inner.nope=1': Inner has no field 'inner.nope'"),
    (["steps.x=1"], r"override 'steps.x=1': steps is not a config"),
    (["inner.rate=1", "inner=2"], r"override 'inner=2' conflicts"),
    (["bad"], r"override 'bad' is not of the form dotted.path=value"),
])
def test_override_errors_name_the_item(overrides, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(Outer(steps=1), overrides)


def test_overrides_apply_at_once():
  cfg = apply_overrides(Outer(steps=1), ["inner.rate=0.1", "layers=3,4", "maybe_layers=none",
                                         "path=/p", "flag=yes"])
  assert cfg == Outer(steps=1, inner=Inner(rate=0.1), layers=(3, 4), path="/p", flag=True)


def test_drafter_options_share_the_parser():
  cfg = BenchmarkConfig(drafter_options=("eagle.depth=4", "medusa.choices=tree8",
                                         "medusa.tree=[[0],[0,0]]"))
  assert cfg.options_for("eagle") == {"depth": 4}
  assert cfg.options_for("medusa") == {"choices": "tree8", "tree": [[0], [0, 0]]}
  assert cfg.options_for("hydra") == {}
  for bad in ("eagle=4", "eagle.depth=", "eagle.depth"):
    with pytest.raises(ValueError, match=f"drafter option '{bad}' is not of the form "
                                         "method.option=value"):
      BenchmarkConfig(drafter_options=(bad,)).options_for("eagle")
