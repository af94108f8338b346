"""`python -m experiments.reproduce`: every table on a tiny checkpoint with tiny sizes, in one
job (the path `all` takes): the files, the columns, greedy outputs equal to autoregressive
decoding, and sampled rows only for methods the exact-law battery of tests/test_speculative.py
covers, one of them checked against the target's law with the options its row ran with."""

from __future__ import annotations

import json
import math

import pytest

from specjax import drafters
from specjax.config_utils import load_config
from specjax.lab.reproduce import ReproduceConfig, run
from specjax.lab.tables import TABLES
from specjax.lab.tables.theory import expected_tokens, per_token_acceptance
from specjax.verify import LossyRuleWarning
from tests.helpers import tiny_targets as tt

METHODS = ("autoregressive", "prompt_lookup", "eagle")


def _folders(root):
  """A tiny HF target with a tokenizer and an EAGLE folder (random weights) for it. The draft
  LM is the target's own folder: every draft token is accepted, so the peers table can check
  that transformers' assisted generation runs the same rounds as specjax's draft LM."""
  import specjax
  from specjax.drafters import io
  from tests.lab.test_benchmark import _user_checkpoint
  target_dir = _user_checkpoint(root / "target")
  target = specjax.load_target(str(target_dir), dtype="float32")
  io.export_drafter(root / "eagle", tt.learned_drafter("eagle", target), target, "eagle")
  return target_dir


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  root = tmp_path_factory.mktemp("reproduce")
  target_dir = _folders(root)
  cfg = load_config("configs/reproduce.py", [
      f"target={target_dir}", f"drafter.draft_lm={target_dir}", f"drafter.eagle={root / 'eagle'}",
      f"methods={','.join(METHODS)}",
      # Chains of 4 (the default is 1): after the prefill, one round emits the other 5 tokens.
      # EAGLE's tree keeps every candidate (2 levels of 2 children), which k-sequential
      # selection of its i.i.d. children needs (the sampling table).
      "drafter_options=draft_lm.num_tokens=4,eagle.depth=2,eagle.top_k=2,eagle.total_tokens=6",
      "datasets=humaneval,stdlib_docstrings", "num_prompts=2", "max_prompt_tokens=24",
      "max_new_tokens=6", "profile_repeats=1", "methods_table.timing_repeats=2",
      # Two row groups (the default has three): greedy, and T = 0.7 with top-p 0.9.
      "methods_table.temperatures=0,0.7", "methods_table.top_p=1,0.9",
      "sampling_table.methods=eagle", "sampling_table.children=top_k,iid",
      "sampling_table.timing_repeats=1",
      "theory_table.methods=prompt_lookup", "theory_table.lengths=3", "budget_table.methods=eagle",
      "budget_table.nodes=2", "batch_table.methods=prompt_lookup", "batch_table.sizes=1,2",
      "batch_table.num_prompts=2",
      f"out={root / 'out'}"])
  names = [n for n in TABLES if n != "peers" or _has_transformers()]
  lines = []
  with pytest.warns(LossyRuleWarning, match="'typical' is LOSSY"):  # the sampling table's
    done = run(names, cfg, echo=lines.append)
  return cfg, done, "\n".join(lines)


def _has_transformers() -> bool:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    return False
  return True


def _header(markdown: str) -> list[str]:
  line = next(line for line in markdown.splitlines() if line.startswith("| "))
  return [c.strip() for c in line.strip("|").split("|")]


def _rows(markdown: str) -> list[list[str]]:
  lines = [line for line in markdown.splitlines() if line.startswith("| ")][1:]
  return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_every_table_writes_its_files_and_prints_its_time(job):
  cfg, done, printed = job
  out = cfg.out
  for name, d in done.items():
    for ext in ("md", "json", "png"):
      assert f"{out}/{name}.{ext}" in d["files"], (name, ext)
    saved = json.loads(open(f"{out}/{name}.json").read())
    assert saved["table"] == name and saved["config"]["target"] == cfg.target
    assert saved["provenance"]["versions"]["jax"] and saved["seconds"] > 0
    assert open(f"{out}/{name}.md").read().startswith("Measured with specjax ")
    assert f"{name}: " in printed and d["result"].markdown in printed
  assert "time per table: " in printed


def test_methods_table(job):
  cfg, done, _ = job
  result = done["methods"]["result"]
  datasets = ["humaneval", "stdlib_docstrings"]
  assert _header(result.markdown) == ["T", "top-p", "method", "drafting"] + [
      f"{d} {w}" for d in datasets for w in ("tau", "speedup")] + ["mean tau", "mean speedup"]
  rows = _rows(result.markdown)
  assert [tuple(r[:3]) for r in rows] == [(t, p, m) for t, p in (("0", "1"), ("0.7", "0.9"))
                                          for m in METHODS]
  # How each row drafted: greedy matching of top-k children at T = 0; at T > 0 EAGLE draws
  # its children (its default, i.i.d.), verified by recursive rejection.
  assert [r[3] for r in rows] == ["-", "top_k, greedy", "top_k, greedy",
                                  "-", "top_k, recursive", "iid, recursive"]
  assert all("±" in r[5] for r in rows)  # mean and spread over the timed passes
  assert "'recursive', lossless" in result.markdown
  records = result.payload["records"]
  assert len(records) == 2 * len(datasets) * len(METHODS)
  for r in records:
    assert r["options"] is None  # the config's options, written as such
    assert len(r["speedup_repeats"]) == cfg.methods_table.timing_repeats
    assert r["new_tokens"] == cfg.num_prompts * cfg.max_new_tokens and r["tau"] >= 1.0
    assert (r["temperature"], r["top_p"]) in {(0.0, 1.0), (0.7, 0.9)}
    if r["temperature"] == 0:
      assert r["matches_autoregressive"], r["method"]
  assert result.payload["differ"] == []


def test_sampling_table(job):
  """Per learned drafter at T = 1, a row per children mode with tau and speedup under each rule:
  k-sequential selection of top-k children is left out, with the reason; typical acceptance's
  columns and records are marked LOSSY; each record names the children and rule it ran with."""
  _, done, _ = job
  result = done["sampling"]["result"]
  assert _header(result.markdown) == ["drafter", "children"] + [
      f"{rule} {w}" for rule in ("recursive", "kseq", "typical (LOSSY)")
      for w in ("tau", "speedup")]
  rows = _rows(result.markdown)
  assert [tuple(r[:2]) for r in rows] == [("eagle", "top_k"), ("eagle", "iid")]
  assert rows[0][4:6] == ["-", "-"] and "-" not in rows[1]
  assert "- kseq: rule 'kseq' needs i.i.d. sampled children" in result.markdown
  assert [(k["children"], k["rule"]) for k in result.payload["skipped"]] == [("top_k", "kseq")]
  records = result.payload["records"]
  assert sorted((r["children"], r["rule"], r["lossy"]) for r in records) == sorted([
      ("top_k", "recursive", False), ("iid", "recursive", False), ("iid", "kseq", False),
      ("top_k", "typical", True), ("iid", "typical", True)])
  assert all(r["temperature"] == 1 and r["tau"] >= 1 for r in records)


def test_sampled_rows_follow_the_targets_law(job):
  """Every sampled row (T = 0.7, top-p 0.9) is a method whose sampling the exact-law battery
  checks, and prompt lookup, with the chain its row ran with, passes that battery on the tiny
  sampling target at that sampling."""
  from tests import test_speculative as battery
  from tests.helpers.exact_law import SAMPLINGS, check_exact_law
  _, done, _ = job
  rows = [r for r in done["methods"]["result"].payload["records"] if r["temperature"] > 0]
  assert {(r["temperature"], r["top_p"]) for r in rows} == {(0.7, 0.9)}
  covered = {f for f in drafters.names() if any(n == f or n.startswith(f + "_")
                                                for n in battery._SAMPLING_DRAFTERS)}
  assert {r["method"] for r in rows} - {"autoregressive"} <= covered
  nodes = next(r["draft_nodes"] for r in rows if r["method"] == "prompt_lookup")
  target = tt.sampling_target()
  drafter = drafters.build("prompt_lookup", target, num_tokens=nodes)
  check_exact_law(target, drafter, "prompt_lookup", SAMPLINGS["T0.7_p0.9"], seed=20)


def test_depth_table(job):
  _, done, _ = job
  result = done["depth"]["result"]
  assert _header(result.markdown)[:4] == ["drafter", "dataset", "nodes", "tau"]
  rows = _rows(result.markdown)
  assert {r[0] for r in rows} == {"eagle"}  # the learned drafters only
  for r in result.payload["records"]:
    assert all(a is None or 0 <= a <= 1 for a in r["acceptance_by_depth"])
    assert len(r["acceptance_by_depth"]) == r["draft_nodes"]
  assert len(_header(result.markdown)) <= 4 + max(r["draft_nodes"] for r in
                                                  result.payload["records"])


def test_theory_table(job):
  _, done, _ = job
  result = done["theory"]["result"]
  assert _header(result.markdown)[:3] == ["method", "g", "a"]
  records = result.payload["records"]
  assert [(r["method"], r["g"]) for r in records] == [("prompt_lookup", 3)]
  for r, row in zip(records, _rows(result.markdown)):
    assert r["draft_nodes"] == r["g"] and 0 <= r["a"] <= 1
    assert r["predicted_tokens_per_call"] == pytest.approx(expected_tokens(r["a"], r["g"]))
    assert 1 <= r["tokens_per_round"] <= r["g"] + 1
    # A noisy timing is marked, never dropped: the expected speedups rest on it.
    assert row[9].endswith("?") == bool(r["unreliable_figures"])


def test_leviathan_formula_and_acceptance_fit():
  assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
  assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
  # 10 rounds of a chain of 2: 4 accept none, 2 accept one, 4 accept both: 10 of 16 tests pass.
  assert per_token_acceptance([4, 2, 4], 2) == pytest.approx(10 / 16)


def test_budget_table(job):
  _, done, _ = job
  result = done["budget"]["result"]
  assert _header(result.markdown) == ["nodes", "eagle tau", "eagle speedup", "oracle tau",
                                      "oracle verify / AR step", "oracle speedup", "oracle bound"]
  assert [r[0] for r in _rows(result.markdown)] == ["2"]
  (record,) = result.payload["records"]
  assert record["method"] == "eagle" and record["draft_nodes"] == 2
  assert record["matches_autoregressive"]
  (oracle,) = result.payload["oracle"]["rows"]
  # Every node accepted: the prefill's token, then rounds of 3 tokens up to the budget.
  new = job[0].max_new_tokens
  assert oracle["n"] == 2 and oracle["tau"] == pytest.approx(new / (1 + math.ceil((new - 1) / 3)))


def test_peers_table(job):
  cfg, done, _ = job  # 2 prompts x 6 new tokens: the prefill and one round of 5 tokens each
  if "peers" not in done:
    pytest.skip("transformers is not installed")
  result = done["peers"]["result"]
  rows = _rows(result.markdown)
  assert [r[0].split()[0] for r in rows] == ["specjax"] * 3 + ["transformers"] * 3
  assert all(r[-1] == "yes" for r in rows)  # every greedy output equals specjax's
  records = result.payload["records"]
  assert records[3]["tau"] == pytest.approx(1.0, abs=0.2)  # greedy: one token per call
  # Assisted generation with the same draft LM drafting a fixed number of tokens is specjax's
  # draft LM: the same rounds, so the same target calls. (With transformers' early stop on draft
  # confidence left on, the random target drafting for itself stops early: its probabilities
  # are near uniform, and it takes 6 calls here instead of 4.)
  ours, theirs = records[1], records[4]
  assert ours["method"] == theirs["method"] == "draft_lm"
  assert ours["tau"] > 2.0  # the target drafting for itself: every draft token accepted
  assert ours["target_calls"] == theirs["target_calls"] == 2 * cfg.num_prompts
  assert "threads" in result.markdown


def test_batch_table(job):
  _, done, _ = job
  result = done["batch"]["result"]
  assert _header(result.markdown) == ["method"] + [
      f"batch {b} {w}" for b in (1, 2) for w in ("tokens/s", "tau", "speedup")]
  assert [r[0] for r in _rows(result.markdown)] == ["autoregressive", "prompt_lookup"]
  assert result.payload["differ"] == []
  assert {r["batch_size"] for r in result.payload["records"]} == {1, 2}
  # tau pools the calls each row took part in: one token per call for AR at any batch size.
  assert all(r["tau"] == pytest.approx(1.0) for r in result.payload["records"]
             if r["method"] == "autoregressive")


def test_docstring_prompts_are_documented_functions_cut_after_their_docstring():
  from specjax import data
  from specjax.data.docstrings import documented_functions
  source = ('class A:\n    def f(self, x):\n        """Return x twice, as the tests of this '
            'module expect it."""\n        return 2 * x\n\ndef g():\n    """short"""\n'
            '    return 1\n')
  (fn,) = documented_functions("m.py", source)
  assert fn["name"] == "f" and fn["prompt"].startswith("def f(self, x):\n    \"\"\"Return")
  assert fn["prompt"].endswith('expect it."""\n') and fn["body"] == "return 2 * x\n"
  prompts = data.load_stdlib_docstrings()
  assert len(prompts) >= 16 and all(p["prompt"].lstrip().startswith(("def ", "async def "))
                                    for p in prompts)


def test_every_table_has_its_config_in_the_jobs():
  """A registered table's config is the job config's field `<name>_table`, of the table's class,
  and `--set <name>_table.<field>=...` reaches it."""
  import dataclasses

  from specjax.config_utils import apply_overrides
  fields = {f.name for f in dataclasses.fields(ReproduceConfig)}
  for name, table in TABLES.items():
    assert table.name == name and f"{name}_table" in fields, name
    assert isinstance(ReproduceConfig().table(name), table.config), name
  cfg = apply_overrides(ReproduceConfig(), ["methods_table.temperatures=0,1",
                                            "methods_table.top_p=1", "theory_table.lengths=2"])
  assert cfg.methods_table.temperatures == (0.0, 1.0) and cfg.theory_table.lengths == (2,)
