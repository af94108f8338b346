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
