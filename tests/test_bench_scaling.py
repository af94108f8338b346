"""The benchmarks on device meshes: `python -m experiments.benchmark --set mesh=...` and
`experiments.bench_scaling`, on a one-layer random target with the embedded tokenizer (compiling
for 8 devices is what costs here, and it grows with the layers)."""

from __future__ import annotations

import json

import pytest

from experiments import bench_scaling
from specjax import sharding
from specjax.lab.benchmark import AR


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
  """A saved one-layer Qwen3 (4 heads, 2 KV heads: tp=4 replicates the KV heads) that has the
  embedded target's tokenizer, so the benchmark's prompts encode."""
  import os

  import tokenizers

  import specjax
  from specjax import assets
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(assets.TARGET_DIR, "tokenizer.json"))
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=tokenizer.get_vocab_size(),
                            hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                            num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                            max_position_embeddings=512)
  path = tmp_path_factory.mktemp("tiny_target")
  specjax.save_hf(specjax.Target.random(cfg, seed=1, tokenizer=tokenizer), path)
  return path


def _reject_nan(name):
  raise ValueError(f"the JSON holds {name}")


def test_benchmark_on_a_mesh_reports_bytes_per_device(tiny_target_dir, tmp_path, capsys):
  """`--set mesh=dp=2,tp=4` (the value holds '='): every method runs on the mesh, greedy
  outputs equal autoregressive's, and the printout and results.json name the mesh and the
  parameter bytes each device holds, for the target and each drafter."""
  from experiments import benchmark as entry
  entry.main(["--set", "mesh=dp=2,tp=4", "--set", f"target={tiny_target_dir}",
              "--set", f"methods={AR},prompt_lookup", "--set", "datasets=humaneval",
              "--set", "num_prompts=1", "--set", "max_new_tokens=6",
              "--set", "profile_repeats=2", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert "Mesh: dp=2,tp=4 over 8 cpu devices" in out
  saved = json.loads((tmp_path / "results.json").read_text(), parse_constant=_reject_nan)
  assert saved["config"]["mesh"] == "dp=2,tp=4"
  assert [r["method"] for r in saved["records"]] == [AR, "prompt_lookup"]
  assert all(r["matches_autoregressive"] for r in saved["records"])
  lay = saved["layout"]
  assert lay["mesh_spec"] == "dp=2,tp=4"
  assert list(lay["param_bytes"]) == ["target", "prompt_lookup"]
  t = lay["param_bytes"]["target"]
  # Split 4 ways over model (norms replicated), stored once per data row of the mesh: 2 copies.
  assert 0 < t["min"] <= t["max"] < t["one_copy"] / 2
  assert 2 * t["one_copy"] <= t["total"] < 2.2 * t["one_copy"]
  for name in lay["param_bytes"]:
    assert f"| {name} | " in out
  assert (tmp_path / "results.md").read_text().count("Mesh: dp=2,tp=4") == 1


def test_default_meshes_are_those_the_heads_divide(tiny_target_dir):
  """dp=N,tp=1 / N/2,2 / N/4,4 / 1,N as far as N splits, and of those the ones the target's 4
  heads divide (tp=8 is skipped, with the reason)."""
  import jax

  import specjax
  assert bench_scaling.candidate_meshes(1) == ["dp=1,tp=1"]
  assert bench_scaling.candidate_meshes(2) == ["dp=2,tp=1", "dp=1,tp=2"]
  specs = bench_scaling.candidate_meshes(8)
  assert specs == ["dp=8,tp=1", "dp=4,tp=2", "dp=2,tp=4", "dp=1,tp=8"]
  target = specjax.load_target(tiny_target_dir, dtype="float32")
  meshes, skipped = bench_scaling.fitting_meshes(target, specs, jax.devices())
  assert [sharding.mesh_spec(m) for m in meshes] == specs[:3]
  assert len(skipped) == 1 and skipped[0].startswith("dp=1,tp=8: num_attention_heads 4")


def test_kv_cache_bytes_are_those_generate_allocates(tiny_target_dir):
  """The figure from the cache's shape and `cache_spec` equals the bytes each device holds of
  the cache `generate` builds (rows padded to dp, KV heads split over tp=2, replicated at tp=4),
  with a drafter's nodes in the cache length."""
  import specjax
  from specjax import decoding, drafters
  from specjax.sampling import SamplingConfig
  target = specjax.load_target(tiny_target_dir, dtype="float32")
  drafter = drafters.build("prompt_lookup", target)
  for spec in ("dp=4,tp=2", "dp=2,tp=4"):
    placed = target.on_mesh(spec)
    run = decoding.prepare(placed, [[1, 2, 3]] * 3, 5, drafter, SamplingConfig(), 0, [], 8)
    held = set(sharding.bytes_per_device(run.fresh_cache()).values())
    length = decoding.cache_length(8, 5, drafter.num_nodes, target.config.max_position_embeddings)
    assert held == {bench_scaling.kv_cache_bytes(target.config, placed.mesh, 3, length)}, spec


def test_bench_scaling_table_and_json(tiny_target_dir, tmp_path, capsys):
  """Two meshes x batches {1, 2}: a table row each with tokens/s, tau, bytes per device and
  '= first mesh'; the JSON has the same rows, and the outputs agree across meshes."""
  out = tmp_path / "scaling.json"
  results = bench_scaling.main(["--target", str(tiny_target_dir), "--devices", "2",
                                "--meshes", "dp=2,tp=1;dp=1,tp=2", "--batches", "1,2",
                                "--max-new-tokens", "4", "--out", str(out)])
  printed = capsys.readouterr().out
  assert printed.startswith("devices: 2 x cpu") and "only show that it runs" in printed
  table = [line for line in printed.splitlines() if line.startswith("| ")]
  assert table[0].startswith("| mesh | batch | tokens/s | tau | target params/device |")
  assert [line.split(" | ")[:2] for line in table[1:]] == [
      ["| dp=2,tp=1", "1"], ["| dp=2,tp=1", "2"], ["| dp=1,tp=2", "1"], ["| dp=1,tp=2", "2"]]
  assert all(line.endswith("| yes |") for line in table[1:])
  saved = json.loads(out.read_text(), parse_constant=_reject_nan)
  assert saved["rows"] == json.loads(json.dumps(results["rows"]))
  assert saved["provenance"]["command"] and saved["num_devices"] == 2
  rows = {(r["mesh"], r["batch"]): r for r in saved["rows"]}
  for r in saved["rows"]:
    assert r["matches_first_mesh"] and r["tokens_per_second"] > 0 and r["tau"] == 1.0
    dp = int(r["mesh"].split(",")[0].removeprefix("dp="))
    assert r["new_tokens"] == 4 * r["batch"] and r["padded_batch"] == -(-r["batch"] // dp) * dp
  # tp=2 halves the target's split weights; dp=2 keeps a whole copy on each device.
  dp, tp = rows[("dp=2,tp=1", 2)], rows[("dp=1,tp=2", 2)]
  assert tp["target_param_bytes"]["max"] < 0.6 * dp["target_param_bytes"]["max"]
  assert dp["target_param_bytes"]["max"] == dp["target_param_bytes"]["one_copy"]
  # Batch 2: dp=2 splits the rows, tp=2 the 2 KV heads, so keys and values weigh the same; tp=2
  # holds both rows' int32 lengths. Batch 1 on dp=2 is padded to 2 rows.
  assert tp["kv_cache_bytes_per_device"] - dp["kv_cache_bytes_per_device"] == 4
  assert rows[("dp=2,tp=1", 1)]["kv_cache_bytes_per_device"] == dp["kv_cache_bytes_per_device"]
