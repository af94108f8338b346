"""Bad configuration, in one table: `--set` overrides of the shipped configs, configs built in
Python, and the command lines of the entry points.

Each config case must raise a ValueError naming the field, the value and what the field takes
(its type, range or choices), before anything runs; each command line must exit with status 2
and one line `error: ...` (argparse's own usage errors included). Nothing here loads a model,
so the table runs in seconds.
"""

from __future__ import annotations

import dataclasses

import pytest

from specjax.config_utils import load_config
from specjax.lab.benchmark import BenchmarkConfig
from specjax.models.config import ModelConfig
from specjax.train.optim import OptimConfig


def override(config: str, *items: str):
  return lambda: load_config(f"configs/{config}.py", list(items))


def bench(*items: str):
  return override("benchmark", *items)


def repro(*items: str):
  return override("reproduce", *items)


def eagle(*items: str):
  return override("eagle_stdlib", *items)


def lm(*items: str):
  return override("target_stdlib", *items)


CASES = {
    # -- benchmark: sizes (negative sizes once acted as Python slices) --------------------------
    "num_prompts_negative": (bench("num_prompts=-1"),
                             r"override 'num_prompts=-1': num_prompts must be an int >= 1, "
                             r"got '-1'"),
    "num_prompts_zero": (bench("num_prompts=0"), r"num_prompts must be an int >= 1, got '0'"),
    "num_prompts_float": (bench("num_prompts=2.5"), r"num_prompts must be an int, got '2\.5'"),
    "max_prompt_tokens_negative": (bench("max_prompt_tokens=-4"),
                                   r"max_prompt_tokens must be an int >= 1, got '-4'"),
    "max_prompt_tokens_zero": (bench("max_prompt_tokens=0"),
                               r"max_prompt_tokens must be an int >= 1, got '0'"),
    "max_new_tokens_zero": (bench("max_new_tokens=0"), r"max_new_tokens must be an int >= 1"),
    "profile_repeats_zero": (bench("profile_repeats=0"), r"profile_repeats must be an int >= 1"),
    # -- benchmark: sampling ---------------------------------------------------------------------
    "temperature_negative": (bench("temperature=-0.5"),
                             r"temperature must be a float >= 0, got '-0\.5'"),
    "temperature_nan": (bench("temperature=nan"), r"temperature must be a finite number"),
    "temperature_inf": (bench("temperature=inf"), r"temperature must be a finite number"),
    "temperature_word": (bench("temperature=warm"), r"temperature must be a number, got 'warm'"),
    "rule_unknown": (bench("rule=greedy"),
                     r"rule must be one of 'recursive', 'kseq' or 'typical', got 'greedy'"),
    "sampling_table_rule_unknown": (repro("sampling_table.rules=recursive,spectr"),
                                    r"sampling_table\.rules\[1\] must be one of 'recursive', "
                                    r"'kseq' or 'typical', got 'spectr'"),
    "sampling_table_children_unknown": (repro("sampling_table.children=beam"),
                                        r"sampling_table\.children\[0\] must be one of 'top_k', "
                                        r"'iid' or 'wor', got 'beam'"),
    "top_p_zero": (bench("top_p=0"), r"top_p must be a float in \(0, 1\], got '0'"),
    "top_p_above_one": (bench("top_p=1.5"), r"top_p must be a float in \(0, 1\]"),
    "top_k_negative": (bench("top_k=-1"), r"top_k must be an int >= 0, got '-1'"),
    "seed_negative": (bench("seed=-1"), r"seed must be an int in \[0, 4294967296\), got '-1'"),
    "seed_too_large": (bench("seed=4294967296"), r"seed must be an int in \[0, 4294967296\)"),
    # -- benchmark: words, lists, choices --------------------------------------------------------
    "profile_not_a_bool": (bench("profile=maybe"), r"profile must be true or false, got 'maybe'"),
    "dtype_unknown": (bench("dtype=int8"),
                      r"dtype must be one of 'float32', 'bfloat16' or 'float16', got 'int8'"),
    "datasets_empty": (bench("datasets="), r"datasets must hold at least 1 item\(s\)"),
    "datasets_unknown": (bench("datasets=humaneval,nope"),
                         r"datasets holds 'nope', which is no dataset: datasets are "
                         r"\['humaneval', 'stdlib_heldout', 'stdlib_docstrings'\]"),
    "datasets_empty_item": (bench("datasets=humaneval,,stdlib_heldout"),
                            r"datasets is a comma-separated list without empty items"),
    "prompts_not_jsonl": (bench("prompts=prompts.txt"),
                          r"prompts 'prompts\.txt' is not a JSONL prompt file"),
    "out_empty": (bench("out="), r"out must not be empty, got ''"),
    "target_empty": (bench("target="), r"target must not be empty"),
    "mesh_bad_size": (bench("mesh=dp=x"), r"mesh spec 'dp=x': size 'x' is not an int"),
    "mesh_axis_twice": (bench("mesh=dp=2,dp=2"), r"mesh spec 'dp=2,dp=2' names the data axis "
                                                 r"twice"),
    "mesh_zero": (bench("mesh=tp=0"), r"axis sizes are positive ints or -1"),
    "mesh_unknown_axis": (bench("mesh=pp=2"), r"'pp=2' is not dp=N or tp=N"),
    "drafter_option_syntax": (bench("drafter_options=eagle=4"),
                              r"drafter option 'eagle=4' is not of the form method\.option=value"),
    "chat_option_not_a_bool": (bench("chat_options.enable_thinking=perhaps"),
                               r"chat_options\.enable_thinking must be true or false"),
    "unknown_field": (bench("num_prompt=4"),
                      r"BenchmarkConfig has no field 'num_prompt'; fields: \[.*'num_prompts'"),
    "nested_unknown_field": (eagle("optim.lr=1"),
                             r"OptimConfig has no field 'optim\.lr'; fields: \[.*'learning_rate'"),
    "value_for_a_config": (eagle("optim=3"), r"optim is a config"),
    "field_of_a_value": (bench("num_prompts.x=1"), r"num_prompts is not a config"),
    "no_equals": (bench("num_prompts"), r"override 'num_prompts' is not of the form"),
    # -- reproduce -------------------------------------------------------------------------------
    "batch_sizes_zero": (repro("batch_table.sizes=0"),
                         r"batch_table\.sizes\[0\] must be an int >= 1, got '0'"),
    "batch_sizes_second_zero": (repro("batch_table.sizes=4,0"),
                                r"batch_table\.sizes\[1\] must be an int >= 1"),
    "batch_sizes_empty": (repro("batch_table.sizes="),
                          r"batch_table\.sizes must hold at least 1 item\(s\)"),
    "timing_repeats_zero": (repro("methods_table.timing_repeats=0"),
                            r"methods_table\.timing_repeats must be an int >= 1"),
    "top_p_per_temperature": (repro("methods_table.temperatures=0,1"),
                              r"methods_table\.top_p holds 3 values for 2 temperature\(s\) "
                              r"\[0\.0, 1\.0\]: give one top-p per temperature, or one for all"),
    "sampling_table_not_learned": (repro("sampling_table.methods=prompt_lookup"),
                                   r"sampling_table\.methods holds 'prompt_lookup', which it "
                                   r"cannot run"),
    "temperatures_negative": (repro("methods_table.temperatures=0,-1"),
                              r"methods_table\.temperatures\[1\] must be a float >= 0, got '-1'"),
    "theory_lengths_zero": (repro("theory_table.lengths=0,2"),
                            r"theory_table\.lengths\[0\] must be an int >= 1"),
    "budget_nodes_word": (repro("budget_table.nodes=8,many"),
                          r"budget_table\.nodes\[1\] must be an int, got 'many'"),
    "peer_threads_negative": (repro("peers_table.threads=-2"),
                              r"peers_table\.threads must be an int >= 0"),
    "batch_prompts_zero": (repro("batch_table.num_prompts=0"),
                           r"batch_table\.num_prompts must be an int >= 1"),
    "budget_method_not_learned": (repro("budget_table.methods=prompt_lookup"),
                                  r"budget_table\.methods holds 'prompt_lookup', which it cannot "
                                  r"run: it takes \['dflash'"),
    "batch_method_unknown": (repro("batch_table.methods=nope"),
                             r"batch_table\.methods holds 'nope'"),
    "table_config_set_whole": (repro("batch_table=3"), r"batch_table is a config"),
    "drafter_option_name_of_a_method_not_run": (
        lambda: __import__("specjax.lab.benchmark", fromlist=["x"]).check_drafter_options(
            load_config("configs/benchmark.py", ["drafter_options=medusa.depth=3"]),
            ["autoregressive"]),
        r"drafter option 'medusa\.depth=3': drafter 'medusa' has no option 'depth'; its options: "
        r"\['children', 'choices'"),
    # -- drafter training ------------------------------------------------------------------------
    "learning_rate_nan": (eagle("optim.learning_rate=nan"),
                          r"optim\.learning_rate must be a finite number, got 'nan'"),
    "learning_rate_negative": (eagle("optim.learning_rate=-1e-3"),
                               r"optim\.learning_rate must be a float > 0"),
    "learning_rate_zero": (eagle("optim.learning_rate=0"), r"learning_rate must be a float > 0"),
    "warmup_past_the_end": (eagle("optim.warmup_steps=5000"),
                            r"warmup_steps \(5000\) must be < total_steps \(3600\)"),
    "total_steps_zero": (eagle("optim.total_steps=0"), r"total_steps must be an int >= 1"),
    "adam_b1_one": (eagle("optim.b1=1.0"), r"optim\.b1 must be a float in \[0, 1\)"),
    "clip_norm_zero": (eagle("optim.clip_norm=0"), r"clip_norm must be a float > 0"),
    "train_batch_zero": (eagle("batch_size=0"), r"batch_size must be an int >= 1"),
    "seq_len_one": (eagle("seq_len=1"), r"seq_len must be an int >= 2, got '1'"),
    "source_unknown": (eagle("source=web"),
                       r"source must be one of 'corpus' or 'self_distill', got 'web'"),
    "method_unknown": (eagle("method=medusa2"),
                       r"unknown learned drafter method 'medusa2'; known: \['dflash'"),
    "family_option_of_another_family": (eagle("family.num_heads=2"),
                                        r"num_heads is not an option of eagle \(its options: "),
    "target_layers_negative": (override("eagle3_stdlib", "family.target_layers=-1,2"),
                               r"target_layers\[0\] must be an int >= 0, got '-1'"),
    "export_dtype_unknown": (eagle("export_dtype=int4"), r"export_dtype must be one of "
                                                         r"'float32', 'bfloat16' or 'float16'"),
    "train_steps_zero": (eagle("train_steps=0"), r"train_steps must be an int >= 1"),
    "train_seed_negative": (eagle("seed=-3"), r"seed must be an int in \[0, 4294967296\)"),
    "train_mesh_bad": (eagle("mesh=dp=3,tp=x"), r"mesh spec 'dp=3,tp=x': size 'x' is not an int"),
    "chain_loss_one_depth": (eagle("chain_loss=true"),
                             r"chain_loss scores depths past the first: it needs train_steps >= "
                             r"2"),
    "distill_rows_zero": (eagle("distill_rows=0"), r"distill_rows must be an int >= 1"),
    "eval_every_zero": (eagle("eval_every=0"), r"eval_every must be an int >= 1"),
    "feature_noise_negative": (eagle("family.feature_noise=-0.1"),
                               r"feature_noise must be a float >= 0, got '-0\.1'"),
    # -- target LM training ----------------------------------------------------------------------
    "model_layers_zero": (lm("model.num_layers=0"), r"model\.num_layers must be an int >= 1"),
    "model_layers_float": (lm("model.num_layers=2.5"), r"model\.num_layers must be an int"),
    "model_width_word": (lm("model.hidden_size=wide"), r"model\.hidden_size must be an int, got "
                                                       r"'wide'"),
    "model_heads_not_divisible": (lm("model.num_kv_heads=3"),
                                  r"num_heads \(\d+\) must be a multiple of num_kv_heads \(3\)"),
    "model_architecture_unknown": (lm("model.architecture=gpt2"),
                                   r"unknown architecture 'gpt2'; supported: \['gemma2'"),
    "model_eps_zero": (lm("model.rms_norm_eps=0"), r"model\.rms_norm_eps must be a float > 0"),
    "sequence_past_the_context": (lm("seq_len=100000", "long_steps=0"),
                                  r"sequence length 100000 exceeds the model's context"),
    "long_steps_negative": (lm("long_steps=-1"), r"long_steps must be an int >= 0"),
    "long_steps_past_the_run": (lm("long_steps=100000"),
                                r"long_steps \(100000\) must be < optim\.total_steps"),
    "tokenizer_path_empty": (lm("data.tokenizer_path="), r"data\.tokenizer_path must not be "
                                                          r"empty"),
    # -- configs built in Python -----------------------------------------------------------------
    "python_string_for_an_int": (lambda: BenchmarkConfig(num_prompts="4"),
                                 r"BenchmarkConfig\.num_prompts must be an int, got '4'"),
    "python_bool_for_an_int": (lambda: BenchmarkConfig(max_new_tokens=True),
                               r"BenchmarkConfig\.max_new_tokens must be an int, got True"),
    "python_unknown_keyword": (lambda: BenchmarkConfig(num_prompt=4),
                               r"BenchmarkConfig has no field 'num_prompt'"),
    "python_nan_learning_rate": (lambda: OptimConfig(learning_rate=float("nan")),
                                 r"OptimConfig\.learning_rate must be a finite number"),
    "python_replace_checks_too": (lambda: dataclasses.replace(BenchmarkConfig(), top_p=2.0),
                                  r"BenchmarkConfig\.top_p must be a float in \(0, 1\]"),
    "python_model_float_layers": (lambda: ModelConfig(num_layers=2.0),
                                  r"ModelConfig\.num_layers must be an int, got 2\.0"),
    "python_model_string_width": (lambda: ModelConfig(hidden_size="64"),
                                  r"ModelConfig\.hidden_size must be an int, got '64'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_raises_value_error_naming_the_field(case):
  call, message = CASES[case]
  with pytest.raises(ValueError, match=message):
    call()


# -- command lines ----------------------------------------------------------------------------

def _main(module: str):
  import importlib
  return importlib.import_module(f"experiments.{module}").main


COMMAND_LINES = {
    "benchmark_negative_prompts": ("benchmark", ["--set", "num_prompts=-1"],
                                   r"num_prompts must be an int >= 1"),
    "benchmark_missing_config": ("benchmark", ["--config", "configs/nope.py"],
                                 r"config file .*configs/nope\.py does not exist"),
    "benchmark_set_without_value": ("benchmark", ["--set", "temperature"],
                                    r"override 'temperature' is not of the form"),
    "reproduce_unknown_table": ("reproduce", ["tables"], r"argument table: invalid choice"),
    "reproduce_zero_batch": ("reproduce", ["batch", "--set", "batch_table.sizes=0"],
                             r"batch_table\.sizes\[0\] must be an int >= 1"),
    "reproduce_zero_repeats": ("reproduce", ["methods", "--set", "methods_table.timing_repeats=0"],
                               r"methods_table\.timing_repeats must be an int >= 1"),
    "train_drafter_without_config": ("train_drafter", [], r"the following arguments are "
                                                          r"required: --config"),
    "train_drafter_stop_after_zero": ("train_drafter", ["--config", "configs/eagle_stdlib.py",
                                                        "--stop-after", "0"],
                                      r"--stop-after: must be an int >= 1, got '0'"),
    "train_drafter_nan_learning_rate": ("train_drafter", ["--config", "configs/eagle_stdlib.py",
                                                          "--set", "optim.learning_rate=nan"],
                                        r"optim\.learning_rate must be a finite number"),
    "train_target_zero_layers": ("train_target", ["--set", "model.num_layers=0"],
                                 r"model\.num_layers must be an int >= 1"),
    "tune_tree_zero_prompts": ("tune_tree", ["--method", "eagle", "--num-prompts", "0"],
                               r"--num-prompts: must be an int >= 1, got '0'"),
    "tune_tree_bad_vocab_sizes": ("tune_tree", ["--method", "eagle", "--draft-vocab", "512,x"],
                                  r"--draft-vocab: must be comma-separated ints >= 1"),
    "tune_tree_candidates_not_json": ("tune_tree", ["--method", "eagle", "--candidates", "{x"],
                                      r"--candidates is not JSON"),
    "tune_tree_candidates_unknown_option": ("tune_tree", ["--method", "eagle", "--candidates",
                                                          '[{"dept": 3}]'],
                                            r"drafter 'eagle' has no option 'dept'; its options"),
    "tune_tree_unknown_method": ("tune_tree", ["--method", "eaglex"], r"invalid choice: 'eaglex'"),
    "bench_ar_zero_prompts": ("bench_ar", ["--prompts", "0"], r"must be an int >= 1, got '0'"),
    "bench_scaling_bad_batches": ("bench_scaling", ["--batches", "1,,8"],
                                  r"must be comma-separated ints >= 1"),
    "compare_negative_recent": ("compare_drafters", ["--drafter", "eagle", "--recent-tokens",
                                                     "-1"], r"must be an int >= 0, got '-1'"),
}


@pytest.mark.parametrize("case", list(COMMAND_LINES))
def test_bad_command_line_exits_2_with_one_line(case, capsys):
  module, argv, message = COMMAND_LINES[case]
  with pytest.raises(SystemExit) as exit_info:
    _main(module)(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err and "error: " in err[-1], err
  assert any(__import__("re").search(message, line) for line in err), (message, err)


@pytest.mark.parametrize("module,argv,fields", [
    ("benchmark", [], ["num_prompts: int >= 1 = 16", "top_p: float in (0, 1] = 1.0"]),
    ("reproduce", ["methods"], ["batch_table.sizes: list of int >= 1 (at least 1) = 1,4,16",
                                "methods_table.timing_repeats: int >= 1 = 3"]),
    ("train_drafter", ["--config", "configs/eagle_stdlib.py"],
     ["optim.learning_rate: float > 0 = 0.002", "source: 'corpus' | 'self_distill' = "
      "self_distill", "family.regression_weight: float >= 0 = 1.0"]),
    ("train_drafter", [], ["method: str (required)", "optim.learning_rate: float > 0 = 0.003"]),
    ("train_target", ["--set", "seq_len=256"], ["seq_len: int >= 2 = 256",
                                               "model.num_layers: int >= 1 = "]),
    ("tune_tree", [], ["--num-prompts NUM_PROMPTS", "(an int >= 1; default: 8)"]),
])
def test_help_lists_every_field_with_its_type_and_value(module, argv, fields, capsys):
  with pytest.raises(SystemExit) as exit_info:
    _main(module)([*argv, "--help"])
  assert exit_info.value.code == 0
  out = " ".join(capsys.readouterr().out.split())
  for field in fields:
    assert " ".join(field.split()) in out, field


def test_a_mesh_that_needs_more_devices_says_how_to_get_them():
  """On a CPU, JAX starts with one device unless told: the error says how to ask for more, and
  an entry point gives an explicit spec the devices it names (`cli._cpu_devices_for`)."""
  import argparse

  from specjax import cli, sharding
  with pytest.raises(ValueError, match=r"mesh spec 'dp=4,tp=4' needs 16 devices, but 8 are "
                                       r"available; on a CPU.*JAX_NUM_CPU_DEVICES=N"):
    sharding.make_mesh("dp=4,tp=4")
  assert sharding.spec_devices("dp=1,tp=2") == 2 and sharding.spec_devices("dp=-1,tp=2") is None
  args = argparse.Namespace(num_processes=None)
  assert cli._cpu_devices_for(None, args) is None
  assert cli._cpu_devices_for("auto", args) == "auto"
  # This process's backend has started (and the suite fixes 8 devices): nothing to choose.
  assert cli._cpu_devices_for("dp=1,tp=2", args) is None


def test_an_explicit_mesh_gets_its_cpu_devices():
  """`--set mesh=dp=1,tp=2` on a fresh process: the entry point starts JAX with the 2 CPU
  devices the spec names (it once got one, and the run failed on the mesh)."""
  import os
  import subprocess
  import sys
  code = ("from specjax import cli; import jax; "
          "p = cli.config_parser('x', default_config='configs/benchmark.py'); "
          "cli.load_from_args(p.parse_args(['--set', 'mesh=dp=1,tp=2', '--no-compile-cache'])); "
          "print(jax.device_count())")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True)
  assert out.stdout.split()[-1] == "2"


MORE_CASES = {
    "chat_options_without_template": (bench("chat_options.enable_thinking=false"),
                                      r"chat_options \['enable_thinking'\] are switches of the "
                                      r"chat template, which this run does not use"),
    "two_prompt_files_of_one_name": (bench("datasets=/a/p.jsonl,/b/p.jsonl"),
                                     r"datasets holds several entries named \['p'\]"),
    "batch_larger_than_its_prompts": (repro("batch_table.sizes=1,32"),
                                      r"sizes holds 32, more than the num_prompts \(16\)"),
}


@pytest.mark.parametrize("case", list(MORE_CASES))
def test_more_bad_configs(case):
  call, message = MORE_CASES[case]
  with pytest.raises(ValueError, match=message):
    call()


def test_an_unused_drafter_label_is_refused():
  from specjax.lab.benchmark import check_drafter_folders
  cfg = load_config("configs/benchmark.py", ["drafter.myeagle=/x", "methods=autoregressive"])
  with pytest.raises(ValueError, match=r"drafter\.myeagle labels a folder the run does not "
                                       r"measure"):
    check_drafter_folders(cfg, ["autoregressive"])
  check_drafter_folders(cfg, ["autoregressive", "myeagle"])
