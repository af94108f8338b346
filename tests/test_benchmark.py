"""The main job's library entry (`specjax.benchmark.run`) on a small setting: every figure the
table prints is computed, autoregressive is the reference in the same run, outputs agree."""

from __future__ import annotations

import json
import os

import pytest

from specjax import provenance
from specjax.benchmark import AR, MAX_RELATIVE_SPREAD, BenchmarkConfig, _finish, markdown, run


def _reject_nan(name):
  raise ValueError(f"results.json holds {name}: not valid JSON")


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
    for name in ("t_prefill", "t_draft", "t_verify"):
      assert r[f"{name}_spread_ms"] >= 0, (r["method"], name)
    assert r["unreliable"] == bool(r["unreliable_figures"])
  assert records[0]["t_draft_ms"] == 0 and records[0]["t_draft_spread_ms"] == 0  # no draft phase
  assert records[2]["tau"] > 1.5 and records[2]["t_draft_ms"] > 0
  saved = json.loads((tmp_path / "results.json").read_text(), parse_constant=_reject_nan)
  assert len(saved["records"]) == 3
  assert "layout" not in saved and saved["config"]["mesh"] is None  # one device: as before
  block = saved["provenance"]
  assert block["versions"]["jax"] and block["versions"]["numpy"] and block["backend"]
  assert block["devices"] and block["date_utc"].endswith("Z") and block["command"]
  assert block["config"] == saved["config"]
  table = (tmp_path / "results.md").read_text()
  assert table == markdown(records, cfg, provenance.header(block)) and "| eagle3 |" in table
  assert table.startswith("Measured with specjax ") and "Mesh:" not in table
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


def _record(method, draft, verify, *, spread=0.1, nodes=4, tps=100.0, tau=2.0):
  return {"method": method, "dataset": "d", "tau": tau, "tokens_per_second": tps,
          "target_calls": 16, "new_tokens": 32, "outputs": [[1], [2]], "draft_nodes": nodes,
          "t_prefill_ms": 5.0, "t_prefill_spread_ms": 0.1, "t_draft_ms": draft,
          "t_draft_spread_ms": spread, "t_verify_ms": verify, "t_verify_spread_ms": 0.1}


def test_unreliable_figures_are_marked_not_clamped():
  """A draft time at or below zero, or one whose spread is over MAX_RELATIVE_SPREAD of it, is
  kept as measured and marked (JSON flag, `?` in the table), as is a loop efficiency above 100%;
  a well-measured record is not marked, and autoregressive has no draft phase to judge."""
  records = [_record(AR, 0.0, 4.0, spread=0.0, nodes=0),
             _record("fine", 1.0, 6.0, spread=0.2, tps=101.0),
             _record("negative", -0.3, 6.0),
             _record("noisy", 1.0, 6.0, spread=MAX_RELATIVE_SPREAD * 1.0 + 0.01),
             _record("too_fast", 1.0, 6.0, tps=1000.0)]
  _finish(records)
  by = {r["method"]: r for r in records}
  assert not by[AR]["unreliable"] and not by["fine"]["unreliable"]
  assert by["negative"]["t_draft_ms"] == -0.3  # not clamped
  assert by["negative"]["unreliable_figures"] == ["t_draft"]
  assert by["noisy"]["unreliable_figures"] == ["t_draft"]
  assert by["too_fast"]["loop_efficiency"] > 1 and by["too_fast"]["unreliable_figures"] == [
      "loop_efficiency"]
  rows = {line.split("|")[1].strip(): line.split("|")[1:-1]
          for line in markdown(records, BenchmarkConfig()).splitlines()
          if line.startswith("| ") and "method" not in line}
  assert not any("?" in c for c in rows["fine"]) and not any("?" in c for c in rows[AR])
  assert rows["negative"][5].strip() == "-0.30 ±0.10 ?"  # draft ms/round
  assert rows["negative"][8].strip().endswith("?")  # drafting share rests on it
  assert rows["too_fast"][11].strip().endswith("?") and "?" not in rows["too_fast"][5]
  assert rows["too_fast"][12].strip() == "loop_efficiency"
