"""The main job's library entry (`specjax.benchmark.run`) on a small setting: every figure the
table prints is computed, autoregressive is the reference in the same run, outputs agree."""

from __future__ import annotations

import json
import os

import pytest

from specjax.benchmark import AR, BenchmarkConfig, markdown, run


def test_benchmark_runs_and_reports(tmp_path):
  cfg = BenchmarkConfig(methods=(AR, "prompt_lookup", "eagle3"), datasets=("humaneval",),
                        num_prompts=2, max_new_tokens=16, profile_repeats=4, out=str(tmp_path))
  records = run(cfg)
  assert [r["method"] for r in records] == [AR, "prompt_lookup", "eagle3"]
  ar = records[0]
  assert ar["speedup"] == pytest.approx(1.0) and ar["ideal_speedup_e2e"] == pytest.approx(1.0)
  for r in records:
    assert r["matches_autoregressive"], r["method"]  # greedy: identical tokens
    assert r["new_tokens"] == 2 * 16 and r["t_verify_ms"] > 0 and r["t_prefill_ms"] > 0
    assert r["loop_efficiency"] > 0 and r["ideal_speedup_e2e"] > 0
  assert records[2]["tau"] > 1.5 and records[2]["t_draft_ms"] > 0
  table = (tmp_path / "results.md").read_text()
  assert table == markdown(records, cfg) and "| eagle3 |" in table
  saved = json.loads((tmp_path / "results.json").read_text())
  assert len(saved["records"]) == 3
  assert os.path.exists(tmp_path / "speedup.png")


def test_compare_drafters_runs_equal_trees(capsys):
  """`experiments.compare_drafters`: one tree spec means the same tree for every family (a chain
  of d is EAGLE's depth-d top-1 tree and Medusa's path of zeros), a spec that does not fit a
  family is refused by name, and a run prints one tau row per drafter and dataset."""
  from experiments import compare_drafters as cd
  assert cd.tree_options("3", "eagle") == dict(depth=3, top_k=1, total_tokens=3)
  assert json.loads(cd.tree_options("3", "medusa")["choices"]) == [[0], [0, 0], [0, 0, 0]]
  assert cd.tree_options("7x3x16", "eagle3") == dict(depth=7, top_k=3, total_tokens=16)
  assert cd.tree_options("tree6", "hydra") == dict(choices="tree6")
  with pytest.raises(ValueError, match="'tree6' does not fit eagle"):
    cd.tree_options("tree6", "eagle")
  cd.main(["--drafter", "eagle", "--drafter", "hydra", "--trees", "2", "--num-prompts", "2",
           "--max-new-tokens", "8", "--datasets", "humaneval"])
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
  assert len(rows) == 3 and rows[1].startswith("| eagle | 0.") and "| humaneval |" in rows[2]
  assert all(1.0 <= float(r.split("|")[3]) <= 5.0 for r in rows[1:])  # held-out chain tau
  taus = [float(r.split("|")[-2]) for r in rows[1:]]
  assert all(1.0 <= t <= 3.0 for t in taus)  # a chain of 2 emits at most 3 tokens per call
