"""The main job's library entry (`specjax.lab.benchmark.run`) on a small setting: every figure the
table prints is computed, autoregressive is the reference in the same run, outputs agree."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from specjax import decoding, provenance, verify
from specjax.lab import benchmark, report
from specjax.lab.benchmark import BenchmarkConfig, run, running_figures
from specjax.lab.records import (
  AR,
  MAX_RELATIVE_SPREAD,
  SCHEMA_VERSION,
  MethodRecord,
  PhaseTimings,
  finish,
)

# The keys of a results.json record of a one-device run with phase timings, in the file's order
# (on a mesh a drafter's record also holds param_bytes, after phases_reused).
RESULT_KEYS = [
    "method", "tau", "tokens_per_second", "tokens_per_second_repeats", "target_calls",
    "new_tokens", "wall_seconds", "acceptance_by_depth", "accepted_by_depth", "batch_size",
    "outputs", "prompts", "prefill_chunks", "draft_nodes", "lossy", "t_prefill_ms", "t_draft_ms",
    "t_verify_ms", "t_prefill_spread_ms", "t_draft_spread_ms", "t_verify_spread_ms",
    "prefill_chunks_timed", "phases_reused", "dataset", "prompt_set", "speedup",
    "speedup_repeats", "matches_autoregressive", "draft_share", "ideal_speedup",
    "ideal_speedup_e2e", "loop_efficiency", "unreliable_figures", "unreliable"]


def _reject_nan(name):
  raise ValueError(f"results.json holds {name}: not valid JSON")


def test_benchmark_runs_and_reports(tmp_path, monkeypatch):
  """Two datasets, one of short prompts (a smaller bucket of their own), pad to one length for
  the run: the second reuses the first's programs (no second warm-up) and phase timings (they
  depend on shapes, not prompts) and says so; every other figure is its own."""
  calls = []
  monkeypatch.setattr(benchmark, "generate",
                      lambda *a, **k: calls.append(k["pad_to"]) or decoding.generate(*a, **k))
  prompt_file = tmp_path / "short_prompts.jsonl"
  short_text = "def f(x):\n    return x + 1\n"
  prompt_file.write_text("\n".join(json.dumps(short_text + str(i)) for i in range(2)) + "\n")
  cfg = BenchmarkConfig(methods=(AR, "prompt_lookup", "eagle3"),
                        datasets=("humaneval", str(prompt_file)), num_prompts=2,
                        max_new_tokens=16, profile_repeats=4, out=str(tmp_path / "out"))
  both = run(cfg)
  # 3 warm-ups, then 2 prompts x 3 methods per dataset, all at one padded length.
  assert len(calls) == 3 + 2 * 2 * 3 and len(set(calls)) == 1
  assert [r.dataset for r in both] == ["humaneval"] * 3 + ["short_prompts"] * 3
  records, again = both[:3], both[3:]
  assert [r.method for r in records] == [AR, "prompt_lookup", "eagle3"]
  for first, second in zip(records, again):
    assert not first.phases.phases_reused and second.phases.phases_reused, first.method
    for name in ("t_prefill", "t_draft", "t_verify"):
      assert second.phases.ms(name) == first.phases.ms(name), (first.method, name)
    assert second.outputs != first.outputs and second.matches_autoregressive
  ar = records[0]
  assert ar.speedup == pytest.approx(1.0) and ar.figures.ideal_speedup_e2e == pytest.approx(1.0)
  for r in records:
    assert r.matches_autoregressive, r.method  # greedy: identical tokens
    assert r.new_tokens == 2 * 16 and r.phases.t_verify_ms > 0 and r.phases.t_prefill_ms > 0
    assert r.figures.loop_efficiency > 0 and r.figures.ideal_speedup_e2e > 0
    for name in ("t_prefill", "t_draft", "t_verify"):
      assert r.phases.spread_ms(name) >= 0, (r.method, name)
    assert r.figures.unreliable == bool(r.figures.unreliable_figures)
  assert records[0].phases.t_draft_ms == 0 and records[0].phases.t_draft_spread_ms == 0
  assert records[2].tau > 1.5 and records[2].phases.t_draft_ms > 0
  tmp_path = tmp_path / "out"
  saved = json.loads((tmp_path / "results.json").read_text(), parse_constant=_reject_nan)
  assert len(saved["records"]) == 6 and saved["schema_version"] == SCHEMA_VERSION
  # The file holds each record's JSON form, read back as the same record.
  assert saved["records"] == [r.to_json() for r in both]
  assert [MethodRecord.from_json(r) for r in saved["records"]] == both
  assert list(saved["records"][0]) == RESULT_KEYS
  # At T = 0 a drafter drafts its top-k, matched greedily, whatever children it was built with
  # (eagle3's default draws i.i.d. children at T > 0); the records and the table say so.
  assert [(r.children, r.rule, r.lossy) for r in records] == [
      (None, None, False), ("top_k", "greedy", False), ("top_k", "greedy", False)]
  assert "| eagle3 | top_k, greedy |" in (tmp_path / "results.md").read_text()
  assert "layout" not in saved and saved["config"]["mesh"] is None  # one device: as before
  block = saved["provenance"]
  assert block["versions"]["jax"] and block["versions"]["numpy"] and block["backend"]
  assert block["devices"] and block["date_utc"].endswith("Z") and block["command"]
  assert block["config"] == saved["config"]
  table = (tmp_path / "results.md").read_text()
  assert table == report.markdown(both, cfg, provenance.header(block)) and "| eagle3 |" in table
  assert "### humaneval " in table and "### short_prompts " in table
  assert table.startswith("Measured with specjax ") and "Mesh:" not in table
  assert os.path.exists(tmp_path / "speedup.png")


def test_benchmark_without_phase_timings(tmp_path, monkeypatch):
  """`profile=false`: the same decoding runs (tau, tokens/s, speedup, outputs equal to AR's), but
  no phase is timed, so no profiler program is compiled; the table has only the measured
  columns and no footnote on phase timings."""
  timed = []
  monkeypatch.setattr(benchmark, "phase_timings", lambda *a, **k: timed.append(a) or {})
  cfg = BenchmarkConfig(methods=(AR, "prompt_lookup"), datasets=("humaneval",), num_prompts=2,
                        max_new_tokens=16, profile=False, out=str(tmp_path / "out"))
  records = run(cfg)
  assert not timed
  assert [r.method for r in records] == [AR, "prompt_lookup"]
  for r in records:
    assert r.matches_autoregressive and r.tokens_per_second > 0 and r.speedup > 0
    assert r.phases is None and r.figures is None
    assert not any(key.startswith("t_") or key in ("ideal_speedup", "unreliable")
                   for key in r.to_json())
  table = (tmp_path / "out" / "results.md").read_text()
  assert "| method | drafting | tau | tokens/s | speedup | target calls |\n" in table
  assert "| prompt_lookup | " in table and "ms/round" not in table
  assert report.FOOTNOTE not in table
  assert os.path.exists(tmp_path / "out" / "speedup.png")


def test_phase_timings_need_a_round(tmp_path):
  """A budget of one token runs the prefill alone: no round to time, said before compiling."""
  cfg = BenchmarkConfig(methods=(AR,), datasets=("humaneval",), num_prompts=1, max_new_tokens=1,
                        out=str(tmp_path / "out"))
  with pytest.raises(ValueError, match=r"phase timings need max_new_tokens >= 2 .* got 1"):
    run(cfg)


def test_sampled_runs_name_their_drafting_and_mark_a_lossy_rule(tmp_path, monkeypatch):
  """At T > 0 a drafter's record names the children it drew and the rule that verified them, as
  the table's drafting column does; typical acceptance is marked LOSSY (a warning, the JSON flag,
  the column). A rule the drafter's children cannot serve is refused by name before anything
  compiles."""
  calls = []
  monkeypatch.setattr(benchmark, "generate",
                      lambda *a, **k: calls.append(k["rule"]) or decoding.generate(*a, **k))
  base = dict(methods=(AR, "eagle"), datasets=("humaneval",), num_prompts=1, max_new_tokens=8,
              temperature=1.0, profile=False)
  with pytest.raises(ValueError, match=r"eagle with rule='kseq': rule 'kseq' needs i\.i\.d\. "
                                       r"sampled children .* children are 'wor'"):
    run(BenchmarkConfig(**base, rule="kseq", drafter_options=("eagle.children=wor",),
                        out=str(tmp_path / "kseq")))
  assert calls == []
  out = tmp_path / "typical"
  with pytest.warns(verify.LossyRuleWarning, match="'typical' is LOSSY"):
    records = run(BenchmarkConfig(**base, rule="typical", out=str(out)))  # iid: the default
  assert [(r.children, r.rule, r.lossy) for r in records] == [
      (None, None, False), ("iid", "typical", True)]
  assert json.loads((out / "results.json").read_text())["records"][1]["lossy"] is True
  assert "| eagle | iid, typical LOSSY |" in (out / "results.md").read_text()


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


def test_running_figures_on_the_progress_bar():
  """While a dataset runs the bar shows AR's tokens/s and the fastest method's speedup so far;
  nothing before AR has a timing, or in a run without AR."""
  acc = [{"tokens": 64, "walls": [0.5]}, {"tokens": 64, "walls": [0.25]},
         {"tokens": 64, "walls": [0.4]}]
  assert running_figures([AR, "eagle", "hydra"], acc) == "so far: AR 128 tok/s, best eagle 2.00x"
  assert running_figures([AR], acc[:1]) == "so far: AR 128 tok/s"
  assert running_figures([AR, "eagle"], [{"tokens": 0, "walls": [0.0]}, acc[1]]) == ""
  assert running_figures(["eagle"], acc[1:2]) == ""


class _Bar:
  """What run_methods asks of a tqdm bar, keeping every postfix it was shown."""

  def __init__(self, postfix: str):
    self.postfix, self.shown = postfix, []

  def update(self, n: int) -> None:
    pass

  def set_postfix_str(self, text: str) -> None:
    self.postfix = text
    self.shown.append(text)


def test_running_figures_do_not_pile_up_over_calls():
  """Calls sharing one bar (the reproduce tables' runs) each show their own figures after the
  caller's postfix, and leave that postfix as it was."""
  from specjax.lab.benchmark import run_methods
  from tests.helpers import tiny_targets as tt
  target = tt.greedy_target()
  cfg = BenchmarkConfig(num_prompts=2, max_new_tokens=4)
  bar = _Bar("table=methods")
  for _ in range(2):
    run_methods(target, [(AR, None), ("prompt_lookup", None)], [[5, 6, 7, 5, 6], [9, 8, 7]],
                cfg, bar)
    assert bar.postfix == "table=methods"
  figures = [s for s in bar.shown if s != "table=methods"]
  assert figures and all(s.startswith("table=methods, so far: AR ") and s.count("so far") == 1
                         for s in figures), figures


def _record(method, draft, verify, *, spread=0.1, nodes=4, tps=100.0, tau=2.0):
  return MethodRecord(
      method=method, dataset="d", tau=tau, tokens_per_second=tps,
      tokens_per_second_repeats=[tps], target_calls=16, new_tokens=32, wall_seconds=0.32,
      acceptance_by_depth=[], accepted_by_depth=[], batch_size=1, outputs=[[1], [2]],
      prompts=2, prefill_chunks=2, draft_nodes=nodes, phases=PhaseTimings(
          t_prefill_ms=5.0, t_draft_ms=draft, t_verify_ms=verify, t_prefill_spread_ms=0.1,
          t_draft_spread_ms=spread, t_verify_spread_ms=0.1, prefill_chunks_timed=1))


def test_a_record_round_trips_through_its_json_form(tmp_path):
  """`to_json` writes the flat object results.json holds (a group's figures in its place, an
  unset field left out, an undefined ratio as null), `from_json` reads back the same record,
  with or without its outputs, and `read_results` refuses a file of another schema."""
  from specjax.lab.records import read_results
  ar, slow = _record(AR, 0.0, 4.0, spread=0.0, nodes=0), _record("slow", 0.0, -1.0)
  slow.param_bytes = {"min": 1, "max": 2, "total": 3, "one_copy": 3}
  finish([ar, slow])
  assert slow.figures.draft_share is None and slow.figures.ideal_speedup is None
  for r in (ar, slow):
    d = json.loads(json.dumps(r.to_json(), allow_nan=False))
    assert MethodRecord.from_json(d) == r
    assert "temperature" not in d and "options" not in d and "phases" not in d
    public = r.to_json(outputs=False)
    assert "outputs" not in public and MethodRecord.from_json(public).outputs is None
  assert list(ar.to_json()) == [k for k in RESULT_KEYS if k != "prompt_set"]  # none chosen
  # A reproduce run's options: None (the config's) is written, as null; unset, left out.
  chosen = dataclasses.replace(ar, options=None)
  assert chosen.to_json()["options"] is None and MethodRecord.from_json(chosen.to_json()) == chosen
  d = slow.to_json()
  assert d["draft_share"] is None and list(d).index("param_bytes") == RESULT_KEYS.index(
      "phases_reused") + 1
  assert set(d) - set(RESULT_KEYS) == {"param_bytes"}
  with pytest.raises(ValueError, match=r"holds \['tau_typo'\]"):
    MethodRecord.from_json(dict(d, tau_typo=1.0))
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "records": [d]}))
  assert read_results(str(path))[1] == [slow]
  path.write_text(json.dumps({"records": [d]}))
  with pytest.raises(ValueError, match="schema None"):
    read_results(str(path))


def test_unreliable_figures_are_marked_not_clamped():
  """A draft time at or below zero, or one whose spread is over MAX_RELATIVE_SPREAD of it, is
  kept as measured and marked (JSON flag, `?` in the table), as is a loop efficiency above 100%;
  a well-measured record is not marked, and autoregressive has no draft phase to judge."""
  records = [_record(AR, 0.0, 4.0, spread=0.0, nodes=0),
             _record("fine", 1.0, 6.0, spread=0.2, tps=101.0),
             _record("negative", -0.3, 6.0),
             _record("noisy", 1.0, 6.0, spread=MAX_RELATIVE_SPREAD * 1.0 + 0.01),
             _record("too_fast", 1.0, 6.0, tps=1000.0)]
  finish(records)
  by = {r.method: r for r in records}
  assert not by[AR].figures.unreliable and not by["fine"].figures.unreliable
  assert by["negative"].phases.t_draft_ms == -0.3  # not clamped
  assert by["negative"].figures.unreliable_figures == ["t_draft"]
  assert by["noisy"].figures.unreliable_figures == ["t_draft"]
  assert by["too_fast"].figures.loop_efficiency > 1
  assert by["too_fast"].figures.unreliable_figures == ["loop_efficiency"]
  rows = {line.split("|")[1].strip(): line.split("|")[1:-1]
          for line in report.markdown(records, BenchmarkConfig()).splitlines()
          if line.startswith("| ") and "method" not in line}
  assert not any("?" in c for c in rows["fine"]) and not any("?" in c for c in rows[AR])
  assert rows["negative"][6].strip() == "-0.30 ±0.10 ?"  # draft ms/round
  assert rows["negative"][9].strip().endswith("?")  # drafting share rests on it
  assert rows["too_fast"][12].strip().endswith("?") and "?" not in rows["too_fast"][6]
  assert rows["too_fast"][13].strip() == "loop_efficiency"


def test_bound_with_prefill_scales_the_timed_prefill_by_chunks():
  """The prefill was timed on a prompt of 2 chunks; the run's 2 prompts took 6 chunks in all:
  the bound counts 3 timed prefills for both runs (AR: 30 steps after the first tokens; the
  method: 14 rounds of 6 ms)."""
  ar, method = _record(AR, 0.0, 4.0, spread=0.0, nodes=0), _record("m", 1.0, 5.0)
  for r in (ar, method):
    r.prefill_chunks, r.phases.prefill_chunks_timed = 6, 2
  finish([ar, method])
  assert method.figures.ideal_speedup_e2e == pytest.approx(
      (3 * 5.0 + 30 * 4.0) / (3 * 5.0 + 14 * 6.0))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _user_checkpoint(path):
  """A user's HF folder: a tiny random Llama with a byte-level BPE tokenizer of its own, ChatML
  special tokens and a chat template in tokenizer_config.json."""
  from specjax.data.tokenizer import train_tokenizer
  from tests.helpers.hf_models import save_hf_model
  save_hf_model("llama_gqa_tied", path, vocab_size=320, num_hidden_layers=3)
  texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
  tok = train_tokenizer(texts, vocab_size=300)
  tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
       "chat_template": CHATML}))
  return path


def test_benchmark_on_a_users_checkpoint_drafters_and_prompts(tmp_path):
  """`--set target=DIR --set drafter.eagle3=DIR --set prompts=FILE.jsonl`: a user's HF folder,
  a published-layout EAGLE-3 head for it and a JSONL of plain, Spec-Bench and chat prompts
  rendered with the checkpoint's chat template (as transformers renders it) give the same table,
  JSON and plots, every method's greedy output equal to autoregressive."""
  import specjax
  from specjax.config_utils import apply_overrides
  from specjax.drafters import io
  from specjax.interop.tokenizer import ChatTemplate
  from tests.helpers import tiny_targets as tt
  folder = _user_checkpoint(tmp_path / "user_model")
  target = specjax.load_target(str(folder), dtype="float32")
  head = tt.learned_drafter("eagle3", target)
  io.export_drafter(tmp_path / "head", head, target, "eagle3")
  prompts = tmp_path / "my_prompts.jsonl"
  lines = ['"def f3(x):\\n"', json.dumps({"question_id": 1, "turns": ["def f9(x):", "more"]}),
           json.dumps({"messages": [{"role": "system", "content": "code"},
                                    {"role": "user", "content": "def f1(x):"}]})]
  prompts.write_text("\n".join(lines) + "\n")

  transformers = pytest.importorskip("transformers")
  theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
  conversation = [{"role": "system", "content": "code"}, {"role": "user", "content": "hi"}]
  assert ChatTemplate.from_folder(folder).render(conversation) == theirs.apply_chat_template(
      conversation, add_generation_prompt=True, tokenize=False)

  cfg = apply_overrides(BenchmarkConfig(), [
      f"target={folder}", f"drafter.eagle3={tmp_path / 'head'}", f"prompts={prompts}",
      "chat_template=true", "methods=autoregressive,eagle3", "num_prompts=3",
      "max_new_tokens=12", "profile_repeats=2", f"out={tmp_path / 'out'}"])
  records = run(cfg)
  assert [(r.method, r.dataset) for r in records] == [(AR, "my_prompts"), ("eagle3", "my_prompts")]
  assert all(r.matches_autoregressive for r in records)
  assert all(r.new_tokens == 3 * 12 for r in records)
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  assert saved["config"]["drafter"] == {"eagle3": str(tmp_path / "head")}
  assert "### my_prompts" in (tmp_path / "out" / "results.md").read_text()
  assert os.path.exists(tmp_path / "out" / "acceptance_by_depth.png")
  with pytest.raises(ValueError, match="no chat template"):
    ChatTemplate.from_folder(tmp_path / "head")


def test_paper_configs_run_on_tiny_checkpoints(tmp_path):
  """configs/paper_*.py name the hub checkpoints and take their paths as overrides: on tiny
  random folders in the published layouts (a DFlash block of 16, an EAGLE-3 head) the code path a
  user with the real weights takes runs, and the template switch (enable_thinking=false) reaches
  the chat template."""
  import specjax
  from specjax.config_utils import load_config
  from specjax.drafters import io
  from specjax.lab.benchmark import build_drafter
  from tests.drafters import test_dflash_format as published
  from tests.helpers import tiny_targets as tt
  folder = _user_checkpoint(tmp_path / "user_model")
  config = json.loads((folder / "tokenizer_config.json").read_text())
  config["chat_template"] = ("{% if enable_thinking is defined and not enable_thinking %}"
                             "<|im_start|>{% endif %}" + CHATML)
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  target = specjax.load_target(str(folder), dtype="float32")
  dflash_config = dict(published.CONFIG, block_size=16, vocab_size=320, num_target_layers=3,
                       dflash_config={"mask_token_id": 319, "target_layer_ids": [0, 1, 2]})
  dflash_dir = published.publish(tmp_path / "dflash", published.published_tensors(dflash_config),
                                 dflash_config)
  prompts = tmp_path / "math.jsonl"
  prompts.write_text('{"prompt": "def f2(x):"}\n{"turns": ["def f5(x):"]}\n')
  cfg = load_config("configs/paper_dflash_qwen3_8b.py", [
      f"target={folder}", f"drafter.dflash={dflash_dir}", f"drafter.dflash_tree={dflash_dir}",
      f"prompts={prompts}", "methods=autoregressive,dflash_tree", "num_prompts=2",
      "max_new_tokens=8", "profile_repeats=1", "dtype=float32", f"out={tmp_path / 'out'}"])
  from specjax.lab.benchmark import load_prompts
  rows = load_prompts(target, str(prompts), cfg)
  assert rows[0][:2] == target.encode("<|im_start|><|im_start|>", add_special_tokens=False)
  records = run(cfg)
  assert [r.method for r in records] == [AR, "dflash_tree"]
  assert records[1].matches_autoregressive and records[1].draft_nodes == 32

  head = tmp_path / "eagle3"
  io.export_drafter(head, tt.learned_drafter("eagle3", target), target, "eagle3")
  cfg = load_config("configs/paper_eagle3_llama31_8b.py", [f"target={folder}",
                                                           f"drafter.eagle3={head}"])
  assert cfg.chat_template and cfg.dtype == "bfloat16"
  drafter = build_drafter("eagle3", target, cfg, cfg.options_for("eagle3"))
  assert drafter.num_nodes == 59
  ar = specjax.generate(target, rows, max_new_tokens=8).tokens
  assert specjax.generate(target, rows, max_new_tokens=8, drafter=drafter).tokens == ar


def test_drafter_options_must_name_a_method_of_the_run():
  """An option naming no method (not the run's, not a registered drafter, not a labelled
  folder) applies to nothing: a clear error instead (a list written as one item names
  '["eagle_2048' ...), before any target work. A config's options for registered methods a
  --set leaves out of the run stay allowed."""
  methods = [AR, "eagle_2048"]
  folders = {"eagle_2048": "specjax/assets/eagle"}
  benchmark.check_drafter_options(BenchmarkConfig(
      drafter=folders, drafter_options=("eagle3.top_k=2", "eagle_2048.draft_vocab=2048")),
      methods)
  for item in ('["eagle_2048.draft_vocab=2048"]', "eagel.top_k=2", "eagle_512.draft_vocab=512"):
    with pytest.raises(ValueError, match="which is no method"):
      benchmark.check_drafter_options(BenchmarkConfig(drafter=folders, drafter_options=(item,)),
                                      methods)
  with pytest.raises(ValueError, match="drafter option"):
    benchmark.check_drafter_options(BenchmarkConfig(drafter_options=("eagle",)), methods)
