"""Bad files, in one table: target checkpoints (`config.json` of the wrong types, broken
weights and tokenizers), specjax drafter folders, prompt files and `generate`'s padding.

Each case takes a fresh copy of a tiny checkpoint or drafter folder, breaks one thing, and must
raise a ValueError that names the file (or line) and the problem; nothing reaches a trace or a
library's own exception. The folders are made once per module with `save_hf` / `save_drafter`.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import specjax
from specjax import drafters
from specjax.data import prompts as prompt_files
from specjax.drafters import io
from specjax.lab.benchmark import BenchmarkConfig, load_prompts
from tests.helpers import tiny_targets as tt

V = tt.GREEDY_VOCAB


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """A saved tiny target (with the shipped tokenizer's first ids as a WordLevel vocabulary is
  not needed: no tokenizer) and a saved Medusa drafter for it."""
  root = tmp_path_factory.mktemp("bad_files")
  target = tt.greedy_target()
  specjax.save_hf(target, root / "target")
  drafter = io.init_drafter("medusa", target)
  io.save_drafter(root / "medusa", "medusa", drafter.net, drafter.params, drafter.d2t,
                  target.config)
  return root, target


def _copy(folders, name, tmp_path):
  root, _ = folders
  shutil.copytree(root / name, tmp_path / name)
  return tmp_path / name


def _edit_json(path, **changes):
  with open(path) as f:
    d = json.load(f)
  for key, value in changes.items():
    node = d
    *parents, leaf = key.split("__")
    for p in parents:
      node = node[p]
    if value is _DELETE:
      del node[leaf]
    else:
      node[leaf] = value
  with open(path, "w") as f:
    json.dump(d, f)


_DELETE = object()


def config_json(**changes):
  return lambda folder: _edit_json(folder / "config.json", **changes)


def write(name, data: bytes):
  def mutate(folder):
    with open(folder / name, "wb") as f:
      f.write(data)
  return mutate


def _truncate(name):
  def mutate(folder):
    path = folder / name
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 3)
  return mutate


def _drop_d2t(folder):
  t = load_file(folder / "model.safetensors")
  del t["d2t"]
  save_file(t, folder / "model.safetensors")


def _d2t_outside(folder):
  t = load_file(folder / "model.safetensors")
  t["d2t"] = (t["d2t"] + V).astype(np.int32)
  save_file(t, folder / "model.safetensors")


TARGETS = {
    "width_as_text": (config_json(hidden_size="32"),
                      r"config\.json: 'hidden_size' is '32' \(str\): it must be an int"),
    "layers_as_float": (config_json(num_hidden_layers=2.0),
                        r"'num_hidden_layers' is 2\.0 \(float\): it must be an int"),
    "eps_null": (config_json(rms_norm_eps=None),
                 r"'rms_norm_eps' is None \(NoneType\): it must be a number"),
    "eps_negative": (config_json(rms_norm_eps=-1e-6), r"'rms_norm_eps' is -1e-06 .*must be a "
                                                      r"float > 0"),
    "width_missing": (config_json(hidden_size=_DELETE), r"'hidden_size' is missing \(a required "
                                                        r"key\)"),
    "vocab_zero": (config_json(vocab_size=0), r"'vocab_size' is 0 \(int\): it must be an int >= 1"),
    "heads_as_list": (config_json(num_attention_heads=[2]), r"'num_attention_heads' is \[2\]"),
    "eos_as_text": (config_json(eos_token_id="2"), r"'eos_token_id' is '2' \(str\)"),
    "eos_negative": (config_json(eos_token_id=[1, -2]), r"'eos_token_id' is \[1, -2\]"),
    "tie_as_text": (config_json(tie_word_embeddings="yes"),
                    r"'tie_word_embeddings' is 'yes' \(str\): it must be true or false"),
    "rope_theta_zero": (config_json(rope_theta=0), r"'rope_theta' is 0 .*must be a float > 0"),
    "kv_heads_not_dividing": (config_json(num_key_value_heads=3),
                              r"config\.json: ModelConfig: num_heads \(2\) must be a multiple of "
                              r"num_kv_heads \(3\)"),
    "rope_scaling_negative": (config_json(rope_scaling={"rope_type": "linear", "factor": -2.0}),
                              r"config\.json: RopeScaling\.factor must be a float > 0"),
    "rope_scaling_unknown": (config_json(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
                             r"unsupported rope scaling type 'yarn'"),
    "dtype_unknown": (config_json(torch_dtype="int8"), r"unsupported checkpoint dtype 'int8'"),
    "architecture_unknown": (config_json(architectures=["FalconForCausalLM"], model_type="falcon"),
                             r"unsupported architecture FalconForCausalLM .*supported: "),
    "config_a_list": (write("config.json", b"[1, 2]"), r"config\.json must hold a JSON object"),
    "config_not_utf8": (write("config.json", b'{"a": "\xff"}'), r"config\.json is not UTF-8"),
    "config_not_json": (write("config.json", b"{oops"), r"config\.json is not valid JSON"),
    "config_empty": (write("config.json", b""), r"config\.json is not valid JSON"),
    "weights_truncated": (_truncate("model.safetensors"), r"corrupt safetensors file"),
    "weights_not_safetensors": (write("model.safetensors", b"PK\x03\x04 not a safetensors"),
                                r"corrupt safetensors file"),
    "generation_config_eos_outside": (
        lambda folder: _edit_json(folder / "generation_config.json", eos_token_id=V + 1),
        r"generation_config\.json: eos_token_id 97 outside the vocabulary \[0, 96\)"),
}


@pytest.mark.parametrize("case", list(TARGETS))
def test_broken_target_folder_is_named(folders, tmp_path, case):
  folder = _copy(folders, "target", tmp_path)
  specjax.load_target(folder)  # the copy loads before it is broken
  mutate, message = TARGETS[case]
  mutate(folder)
  with pytest.raises(ValueError, match=message):
    specjax.load_target(folder)


DRAFTERS = {
    "taps_negative": (config_json(hidden_layers=[-1]),
                      r"drafter config .*config\.json: hidden_layers\[0\] must be >= 0"),
    "taps_as_text": (config_json(hidden_layers="2"), r"hidden_layers must be a list, got '2'"),
    "vocab_size_text": (config_json(draft_vocab_size="96"),
                        r"draft_vocab_size must be an int, got '96'"),
    "target_record_missing_width": (config_json(target__hidden_size=_DELETE),
                                    r"target\.hidden_size field required|target\.hidden_size"),
    "target_record_other_width": (config_json(target__hidden_size=64),
                                  r"was trained for a target with hidden_size 64, this target "
                                  r"has 32"),
    "method_unknown": (config_json(method="medusa2"),
                       r"unknown learned drafter method 'medusa2'"),
    "method_missing": (config_json(method=_DELETE), r"has no 'method'"),
    "net_heads_as_text": (config_json(net__num_heads="4"),
                          r"drafter config .*\(net\): MedusaConfig\.num_heads must be an int, "
                          r"got '4'"),
    "net_unknown_field_ignored_width_zero": (config_json(net__hidden_size=0),
                                             r"MedusaConfig\.hidden_size must be an int >= 1"),
    "tree_not_a_dict": (config_json(tree=[1]), r"tree must be a mapping"),
    "tree_unknown_option": (config_json(tree={"dept": 3}),
                            r"drafter 'medusa' has no option 'dept'; its options: "
                            r"\['children', 'choices'"),
    "config_not_json": (write("config.json", b"{"), r"corrupt drafter config"),
    "config_missing": (lambda folder: os.remove(folder / "config.json"),
                       r"medusa is not a drafter folder of a known format .*no config\.json"),
    "weights_missing": (lambda folder: os.remove(folder / "model.safetensors"),
                        r"drafter weights missing: .*model\.safetensors"),
    "weights_truncated": (_truncate("model.safetensors"), r"corrupt drafter weights"),
    "d2t_missing": (_drop_d2t, r"have no d2t"),
    "d2t_outside_vocab": (_d2t_outside, r"d2t ids outside the target vocabulary \[0, 96\)"),
}


@pytest.mark.parametrize("case", list(DRAFTERS))
def test_broken_drafter_folder_is_named(folders, tmp_path, case):
  _, target = folders
  folder = _copy(folders, "medusa", tmp_path)
  io.load_drafter(folder, target)  # the copy loads before it is broken
  mutate, message = DRAFTERS[case]
  mutate(folder)
  with pytest.raises(ValueError, match=message):
    io.load_drafter(folder, target)


def _prompt_file(tmp_path, data: bytes):
  path = tmp_path / "prompts.jsonl"
  path.write_bytes(data)
  return path


PROMPT_FILES = {
    "not_utf8": (b'"fine"\n"\xff\xfe"\n', r"prompts\.jsonl:2: not UTF-8 text \(byte 0xff at "
                                           r"column 2\)"),
    "not_json": (b'"fine"\n{"prompt": \n', r"prompts\.jsonl:2: not JSON"),
    "empty_text": (b'"fine"\n""\n', r"prompts\.jsonl:2: the prompt is empty"),
    "empty_prompt_key": (b'{"prompt": ""}\n', r"prompts\.jsonl:1: prompt is empty"),
    "number_line": (b"3\n", r"prompts\.jsonl:1: a prompt line is a JSON string or object, got "
                            r"int"),
    "no_prompt_key": (b'{"id": 1}\n', r"prompts\.jsonl:1: no prompt in keys \['id'\]"),
    "prompt_not_text": (b'{"prompt": 5}\n', r"prompts\.jsonl:1: prompt must be a string"),
    "messages_empty": (b'{"messages": []}\n', r"messages must be a non-empty list"),
    "message_without_role": (b'{"messages": [{"content": "hi"}]}\n',
                             r"each message needs a string role and content"),
    "turns_not_text": (b'{"turns": [1]}\n', r"turns must be a non-empty list of strings"),
    "blank_lines_only": (b"\n  \n", r"prompts\.jsonl holds no prompts"),
}


@pytest.mark.parametrize("case", list(PROMPT_FILES))
def test_broken_prompt_file_names_the_line(tmp_path, case):
  data, message = PROMPT_FILES[case]
  with pytest.raises(ValueError, match=message):
    prompt_files.read_prompts(_prompt_file(tmp_path, data))


def test_missing_prompt_file_and_conversation_without_template(tmp_path):
  with pytest.raises(ValueError, match=r"no prompt file at .*nope\.jsonl"):
    prompt_files.read_prompts(tmp_path / "nope.jsonl")
  chat = prompt_files.Prompt(messages=({"role": "user", "content": "a"},
                                       {"role": "assistant", "content": "b"}))
  with pytest.raises(ValueError, match=r"needs the checkpoint's chat template"):
    prompt_files.render(chat, None)


def test_benchmark_keeps_short_prompts_and_says_what_ran(tmp_path):
  """Prompts of one token run (they were once dropped silently below 8 tokens), prompts are cut
  to their last max_prompt_tokens tokens, and the set reports both."""
  from specjax.lab.benchmark import prompt_set
  target = specjax.load_target("specjax/assets/target")
  path = _prompt_file(tmp_path, b'"x"\n"def f():"\n"' + b"a = 1\\n" * 40 + b'"\n')
  cfg = BenchmarkConfig(prompts=str(path), num_prompts=8, max_prompt_tokens=16)
  got = prompt_set(target, str(path), cfg)
  assert len(got.rows) == 3 and got.available == 3 and got.empty == 0
  assert len(got.rows[0]) < 8 and got.truncated == 1 and max(map(len, got.rows)) == 16
  assert load_prompts(target, str(path), cfg) == got.rows


def test_generate_refuses_padding_past_the_context():
  with pytest.raises(ValueError, match=r"pad_to=1000000000 exceeds the model's context of 256"):
    specjax.generate(tt.greedy_target(), [[1, 2, 3]], max_new_tokens=2, pad_to=10**9)


def test_builder_options_are_checked_by_name():
  target = tt.greedy_target()
  with pytest.raises(ValueError, match=r"drafter 'ngram' has no option 'num_token'; its "
                                       r"options: \['match_scale', 'max_ngram'"):
    drafters.build("ngram", target, num_token=3)
  with pytest.raises(ValueError, match=r"drafter 'eagle' has no option 'dept'; its options: "
                                       r"\['children', 'depth', 'draft_temperature'"):
    io.init_drafter("eagle", target, dept=3)


def test_published_drafter_recording_another_target_is_warned_about(folders, tmp_path):
  """A published Medusa folder whose shapes fit the target loads, but one whose config.json
  names another base model than the target's folder says so (the output stays lossless)."""
  import warnings
  root, _ = folders
  target = specjax.load_target(root / "target")
  drafter = io.load_drafter(root / "medusa", target)
  io.export_drafter(tmp_path / "published", drafter, target, "medusa")
  _edit_json(tmp_path / "published" / "config.json",
             base_model_name_or_path="lmsys/vicuna-7b-v1.3")
  with pytest.warns(UserWarning, match=r"records its target as 'lmsys/vicuna-7b-v1\.3', but the "
                                       r"target was loaded from .*target"):
    io.load_drafter(tmp_path / "published", target)
  _edit_json(tmp_path / "published" / "config.json", base_model_name_or_path="org/target")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    io.load_drafter(tmp_path / "published", target)


# -- what a probe of a fresh clone found: files replaced by the wrong kind, silent requests -----


def test_exports_never_replace_a_model_of_another_kind(folders, tmp_path):
  """A drafter exported over a target folder, a model over a drafter folder, a drafter over
  another family's: refused before anything is written; the same kind is replaced as before."""
  root, target = folders
  model, drafter_dir = _copy(folders, "target", tmp_path), _copy(folders, "medusa", tmp_path)
  before = sorted(os.listdir(model))
  medusa = io.init_drafter("medusa", target)
  with pytest.raises(ValueError, match=r"save_drafter would replace .*target, which holds a "
                                       r"model folder, with a medusa drafter folder"):
    io.save_drafter(model, "medusa", medusa.net, medusa.params, medusa.d2t, target.config)
  assert sorted(os.listdir(model)) == before
  specjax.load_target(model)
  with pytest.raises(ValueError, match=r"save_hf would replace .*medusa, which holds a medusa "
                                       r"drafter folder"):
    specjax.save_hf(target, drafter_dir)
  hydra = io.init_drafter("hydra", target)
  with pytest.raises(ValueError, match=r"holds a medusa drafter folder, with a hydra drafter"):
    io.save_drafter(drafter_dir, "hydra", hydra.net, hydra.params, hydra.d2t, target.config)
  io.save_drafter(drafter_dir, "medusa", medusa.net, medusa.params, medusa.d2t, target.config)
  io.load_drafter(drafter_dir, target)


def test_trainers_refuse_an_export_over_another_model_before_training(folders, tmp_path):
  from specjax.train import loop
  model = _copy(folders, "target", tmp_path)
  with pytest.raises(ValueError, match=r"export_dir would replace .*holds a model folder"):
    loop.check_outputs(str(tmp_path / "run"), str(model), False, "eagle drafter")
  with pytest.raises(ValueError, match=r"would lie in the run's own workdir"):
    loop.check_outputs(str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints"), False,
                       "eagle drafter")


def test_a_results_file_never_replaces_another_file(tmp_path):
  from specjax import files
  config = tmp_path / "config.json"
  config.write_text('{"method": "eagle"}')
  with pytest.raises(ValueError, match=r"exists and is not a results file a specjax tool wrote"):
    files.check_output_file(config, "--out file")
  assert config.read_text() == '{"method": "eagle"}'
  files.write_json(tmp_path / "sweep.json", {"provenance": {}, "records": []})
  files.check_output_file(tmp_path / "sweep.json", "--out file")  # its own results: replaced


def test_save_hf_checks_its_arguments(folders, tmp_path):
  _, target = folders
  for kwargs, message in [
      (dict(extra_files={"../escaped.txt": "x"}), r"extra_files name '\.\./escaped\.txt' must be "
                                                  r"a plain file name"),
      (dict(extra_files={"config.json": "{}"}), r"extra_files name 'config\.json'"),
      (dict(extra_files={"a.bin": b"\x00"}), r"extra_files\['a\.bin'\] must be text"),
      (dict(max_shard_bytes=0), r"max_shard_bytes must be >= 1, got 0")]:
    with pytest.raises(ValueError, match=message):
      specjax.save_hf(target, tmp_path / "out", **kwargs)
  assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "out").exists()
  with pytest.raises(ValueError, match=r"save_hf saves a specjax\.Target, got NoneType"):
    specjax.save_hf(None, tmp_path / "out")
  with pytest.raises(ValueError, match=r"save_hf needs a folder path, got NoneType"):
    specjax.save_hf(target, None)


def test_load_target_names_what_it_was_given(folders, tmp_path):
  root, _ = folders
  for arg, message in [(None, r"needs the path of a checkpoint folder, got NoneType"),
                       (5, r"got int"),
                       (root / "target" / "config.json", r"config\.json is a file: load_target "
                                                          r"takes the checkpoint's folder"),
                       (root / "medusa", r"is a specjax drafter's config, not a model's")]:
    with pytest.raises(ValueError, match=message):
      specjax.load_target(arg)


MORE_TARGETS = {
    "eos_outside_vocab": (config_json(eos_token_id=V + 3),
                          r"config\.json: eos_token_id 99 is outside the vocabulary \[0, 96\)"),
    "architectures_unsupported_beside_a_known_type": (
        config_json(architectures=["GPT2LMHeadModel"]),
        r"config\.json: architectures \['GPT2LMHeadModel'\] names no model specjax runs"),
}


@pytest.mark.parametrize("case", list(MORE_TARGETS))
def test_contradicting_target_config_is_named(folders, tmp_path, case):
  folder = _copy(folders, "target", tmp_path)
  mutate, message = MORE_TARGETS[case]
  mutate(folder)
  with pytest.raises(ValueError, match=message):
    specjax.load_target(folder)


def test_drafter_folders_of_another_family_or_size_are_named(folders, tmp_path):
  root, target = folders
  with pytest.raises(ValueError, match=r"holds a medusa drafter, not the eagle drafter asked "
                                       r"for"):
    drafters.build("eagle", target, path=str(root / "medusa"))
  folder = _copy(folders, "medusa", tmp_path)
  _edit_json(folder / "config.json", draft_vocab_size=50)
  with pytest.raises(ValueError, match=r"config\.json says draft_vocab_size 50, its d2t holds "
                                       r"96 ids"):
    io.load_drafter(folder, target)
  for bad in (None, str(root / "target")):
    with pytest.raises(ValueError, match=r"a drafter is read for a loaded target "
                                         r"\(specjax\.load_target\(folder\)\), got"):
      io.load_drafter(root / "medusa", bad)


MORE_PROMPTS = {
    "several_prompt_keys": (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}\n',
                            r"prompts\.jsonl:1: several prompts in one line \(messages, prompt\)"),
    "nested_too_deep": (b"[" * 100_000, r"prompts\.jsonl: JSON nested too deeply"),
    "list_of_numbers": (b"[1, 2]", r"prompts\.jsonl\[0\]: a prompt line is a JSON string or "
                                   r"object, got int"),
}


@pytest.mark.parametrize("case", list(MORE_PROMPTS))
def test_more_broken_prompt_files(tmp_path, case):
  data, message = MORE_PROMPTS[case]
  with pytest.raises(ValueError, match=message):
    prompt_files.read_prompts(_prompt_file(tmp_path, data))


def test_prompt_files_as_editors_write_them(tmp_path):
  """A UTF-8 byte-order mark, CRLF line ends and one JSON list of prompts all read."""
  got = prompt_files.read_prompts(_prompt_file(tmp_path, b'\xef\xbb\xbf"a"\r\n\r\n"b"\r\n'))
  assert [p.text for p in got] == ["a", "b"]
  got = prompt_files.read_prompts(_prompt_file(tmp_path, b'[\n "a",\n {"prompt": "b"}\n]\n'))
  assert [p.text for p in got] == ["a", "b"]


def test_chat_template_refuses_a_switch_it_does_not_read():
  from specjax.interop.tokenizer import ChatTemplate
  template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"
                          "{% if enable_thinking is defined %}!{% endif %}")
  assert template.render([{"role": "user", "content": "x"}], enable_thinking=False) == "x!"
  with pytest.raises(ValueError, match=r"the chat template has no switch \['enable_thinkng'\]; "
                                       r"the variables it reads: \['enable_thinking'\]"):
    template.render([{"role": "user", "content": "x"}], enable_thinkng=False)


def test_the_table_header_says_what_ran():
  from specjax.lab.report import dataset_table
  from tests.helpers.records import record as method_record
  cfg = BenchmarkConfig(num_prompts=16, max_prompt_tokens=256, profile=False)
  record = method_record(dataset="stdlib_heldout", speedup=1.0, prompt_set={
      "prompts": 5, "available": 5, "empty_skipped": 1, "truncated": 3})
  assert dataset_table([record], cfg)[0] == (
      "### stdlib_heldout (T=0.0, 5 prompts (of 16 asked: the dataset has 5) x 128 new tokens, "
      "batch 1; 1 empty prompt(s) skipped, 3 cut to their last 256 tokens)")
