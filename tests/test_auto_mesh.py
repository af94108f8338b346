"""`mesh="auto"`: the model split over every core (one CPU device each) or device it divides
into, the main job's default.

What is checked:
  1. the choice: tp over at most `host_cores()` CPU devices, the largest count the target's
     heads, MLP units and vocabulary divide, dp = 1, None for one core;
  2. the CPU devices: `cpu_devices="auto"` and `--cpu-devices`, which leave a count the
     environment or a started backend fixed, and the entry points asking for it exactly when
     their config's mesh is "auto";
  3. the main job's setting is lossless: the shipped target on the auto mesh of a 2-core host,
     greedy, every shipped drafter family and prompt lookup at batch 1 and 4 emit the
     autoregressive tokens of that mesh and of one device (float32).
"""

from __future__ import annotations

import argparse

import jax
import pytest

import specjax
from specjax import assets, cli, distributed, drafters, sharding
from specjax.interop.hf import load_target
from specjax.lab.benchmark import BenchmarkConfig, run
from tests.helpers import tiny_targets as tt


def _cores(monkeypatch, n: int) -> None:
  monkeypatch.setattr(sharding, "host_cores", lambda: n)


# -- 1. the choice ------------------------------------------------------------------------------


@pytest.mark.parametrize("cores, tp_mesh, tp_greedy", [(2, 2, 2), (3, 2, 2), (8, 8, 2)])
def test_auto_mesh_is_tp_over_the_cores_the_target_divides_into(monkeypatch, cores, tp_mesh,
                                                               tp_greedy):
  """8 query heads split 8 ways on 8 cores; 2 query heads only 2 ways; 3 cores give 2 (3 divides
  no head count here). The devices are the first tp, on one data row."""
  _cores(monkeypatch, cores)
  for cfg, tp in ((tt.MESH_CONFIG, tp_mesh), (tt.GREEDY_CONFIG, tp_greedy)):
    mesh = sharding.auto_mesh(cfg)
    assert sharding.mesh_spec(mesh) == f"dp=1,tp={tp}"
    assert [d.id for d in mesh.devices.flat] == list(range(tp))


def test_one_core_is_one_device(monkeypatch):
  _cores(monkeypatch, 1)
  assert sharding.auto_mesh(tt.MESH_CONFIG) is None
  target = tt.mesh_target()
  assert target.on_mesh("auto") is target and target.mesh is None
  assert sharding.model_mesh("auto", tt.MESH_CONFIG) is None


def test_auto_target_is_placed_as_its_spec_would(monkeypatch):
  _cores(monkeypatch, 2)
  target = tt.mesh_target()
  auto, spelled = target.on_mesh("auto"), target.on_mesh(sharding.make_mesh(
      "dp=1,tp=2", devices=sharding.auto_mesh(target.config).devices.flat))
  assert sharding.mesh_spec(auto.mesh) == "dp=1,tp=2"
  for a, b in zip(jax.tree.leaves(auto.params), jax.tree.leaves(spelled.params)):
    assert a.sharding.spec == b.sharding.spec


# -- 2. the CPU devices -------------------------------------------------------------------------


def test_cpu_devices_auto_leaves_a_fixed_count(monkeypatch):
  """The test session's backend started with 8 devices (tests/conftest.py): "auto" keeps them,
  while an explicit count that differs is an error naming the order of calls."""
  calls = []
  monkeypatch.setattr(distributed.jax.config, "update", lambda *a: calls.append(a))
  distributed._set_cpu_devices("auto")
  assert calls == []
  with pytest.raises(RuntimeError, match="cpu_devices=3 asked after JAX's backend started"):
    distributed._set_cpu_devices(3)


def test_cpu_devices_auto_is_one_per_core_before_the_backend_starts(monkeypatch):
  calls = []
  monkeypatch.setattr(distributed, "_backend_started", lambda: False)
  monkeypatch.setattr(distributed.jax.config, "update", lambda *a: calls.append(a))
  _cores(monkeypatch, 2)
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  distributed._set_cpu_devices("auto")
  assert calls == [("jax_num_cpu_devices", 2)]
  for env, value in (("JAX_NUM_CPU_DEVICES", "4"),
                     ("XLA_FLAGS", "--xla_force_host_platform_device_count=4")):
    calls.clear()
    with monkeypatch.context() as m:
      m.setenv(env, value)
      distributed._set_cpu_devices("auto")
    assert calls == [], env


def test_cpu_devices_flag():
  parser = distributed.add_arguments(argparse.ArgumentParser())
  assert parser.parse_args(["--cpu-devices", "auto"]).cpu_devices == "auto"
  assert parser.parse_args(["--cpu-devices", "4"]).cpu_devices == 4
  assert parser.parse_args([]).cpu_devices is None
  for bad in ("0", "many"):
    with pytest.raises(SystemExit):
      parser.parse_args(["--cpu-devices", bad])


@pytest.mark.parametrize("overrides, flags, expected", [
    ([], [], "auto"),  # configs/benchmark.py: mesh="auto"
    (["mesh=none"], [], None),
    (["mesh=dp=2,tp=4"], [], None),
    ([], ["--cpu-devices", "1"], 1)])
def test_entry_points_ask_for_a_device_per_core_when_the_mesh_is_auto(monkeypatch, overrides,
                                                                      flags, expected):
  seen = []
  monkeypatch.setattr(distributed, "initialize", lambda *a, cpu_devices=None: seen.append(
      cpu_devices))
  parser = cli.config_parser("x", default_config="configs/benchmark.py")
  cfg = cli.load_from_args(parser.parse_args(
      [*flags, "--no-compile-cache", *[f"--set={o}" for o in overrides]]))
  assert seen == [expected]
  assert cfg.mesh == ("auto" if not overrides else None if overrides == ["mesh=none"]
                      else "dp=2,tp=4")


# -- 3. the main job's setting is lossless ----------------------------------------------------

_CODE = ["def add(a, b):\n    return a + b\n\n\ndef sub(", "import os\n\n\ndef walk(root):\n",
         "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(",
         "for i in range(10):\n    print("]
_METHODS = ("prompt_lookup", "eagle", "eagle3", "dflash", "medusa")


@pytest.fixture(scope="module")
def embedded_auto():
  target = load_target(assets.TARGET_DIR)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(sharding, "host_cores", lambda: 2)
    on_mesh = target.on_mesh("auto")
  assert sharding.mesh_spec(on_mesh.mesh) == "dp=1,tp=2"
  return target, on_mesh, [target.encode(t) for t in _CODE]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_shipped_methods_are_lossless_on_the_auto_mesh(embedded_auto, batch):
  """Batch 1 (the main job's) and 4, 24 new tokens: one device's autoregressive tokens from
  autoregressive decoding and each shipped method on the 2-core auto mesh."""
  target, on_mesh, prompts = embedded_auto
  prompts = prompts[:batch]
  kwargs = dict(max_new_tokens=24, pad_to=32)
  reference = specjax.generate(target, prompts, **kwargs).tokens
  assert specjax.generate(on_mesh, prompts, **kwargs).tokens == reference
  for name in _METHODS:
    out = specjax.generate(on_mesh, prompts, drafter=drafters.build(name, on_mesh), **kwargs)
    assert out.tokens == reference, name
    if name != "prompt_lookup":
      assert out.stats.tau > 1.2, name  # premise: drafts are accepted (medusa: 1.41 at batch 1)


def test_benchmark_on_the_auto_mesh_reports_it(tmp_path, monkeypatch):
  """The main job's default mesh on a 2-core host: its table names the mesh and the bytes per
  device, and every method still matches autoregressive decoding."""
  _cores(monkeypatch, 2)
  cfg = BenchmarkConfig(target=None, methods=("autoregressive", "prompt_lookup"),
                        datasets=("humaneval",), num_prompts=1, max_new_tokens=8,
                        profile_repeats=1, mesh="auto", out=str(tmp_path))
  records = run(cfg)
  assert all(r.matches_autoregressive for r in records)
  table = (tmp_path / "results.md").read_text()
  assert "Mesh: dp=1,tp=2 over 2 cpu devices" in table
