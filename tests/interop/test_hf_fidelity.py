"""The same folder in transformers and in specjax: same token ids, same stop, same text.

A difference here is silent: nothing fails, a transformers user just gets another continuation
from the same weights. The tokenizer is compared on text its tests were not tuned on (numpy's
and json's source as installed, odd whitespace, unicode, literal special-token text).
"""

from __future__ import annotations

import inspect
import json
import shutil

import jax
import numpy as np
import pytest

import specjax
from specjax import assets, data
from specjax.interop import hf as hf_interop
from specjax.interop.tokenizer import load_tokenizer
from specjax.target import GenerationDefaults
from tests.helpers import tiny_targets

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EOS_TEXT = "<|endoftext|>"
_EDGE_TEXTS = [
    "", " ", "\t", "\n", "x", " leading space", "trailing spaces   ", "\ttabs\tand  \t mixed\t\n",
    "line one\r\nline two\r\n\r\n", "\r\n\r\r\n\n\n", "é ü ß 日本語 🚀 \u200b zero-width \u0301",
    "\x00\x01\x7f control bytes", "    if x:\n\t\treturn  ''  \n",
    EOS_TEXT, f"a{EOS_TEXT}b", f"{EOS_TEXT}{EOS_TEXT}", f" {EOS_TEXT} ",
    f"def f():\n  return '{EOS_TEXT}'\n",
    "<|endoftext|", "<|endof text|>", f"x\n{EOS_TEXT}\ny",
]


def _held_out_texts() -> list[str]:
  import json.decoder
  import json.encoder

  import numpy.lib.format
  import numpy.polynomial.polynomial
  sources = [inspect.getsource(m) for m in (numpy.lib.format, numpy.polynomial.polynomial,
                                            json.decoder, json.encoder)]
  return sources + [s.replace("\n", "\r\n") for s in sources[:1]] + _EDGE_TEXTS


def _embedded_tokenizer(split_special_tokens: bool):
  tok = data.for_corpus(load_tokenizer(assets.TARGET_DIR))
  tok.encode_special_tokens = split_special_tokens
  return tok


def _saved_target(path, split_special_tokens: bool) -> str:
  """A random target carrying the embedded tokenizer, written by `save_hf`."""
  cfg = tiny_targets.config(8192, num_layers=1).replace(eos_token_id=(0,), bos_token_id=0)
  specjax.save_hf(specjax.Target.random(cfg, 0, _embedded_tokenizer(split_special_tokens)), path)
  return str(path)


@pytest.fixture(params=["shipped", "save_hf", "save_hf_no_split"])
def folder(request, tmp_path):
  """(folder, whether literal special-token text stays text)."""
  if request.param == "shipped":
    return assets.TARGET_DIR, True
  split = request.param == "save_hf"
  return _saved_target(tmp_path, split), split


def test_auto_tokenizer_encodes_and_decodes_like_specjax(folder):
  """`AutoTokenizer.from_pretrained` on the folder gives specjax's ids for held-out text (with and
  without `add_special_tokens`) and decodes any ids, EOS included, to specjax's text, skipping
  special tokens or not."""
  path, split = folder
  tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  target = specjax.load_target(path, dtype="float32")
  eos = target.config.eos_token_id[0]
  for text in _held_out_texts():
    ids = target.encode(text)
    assert tok(text, add_special_tokens=False).input_ids == ids, repr(text[:80])
    assert tok(text).input_ids == ids, repr(text[:80])
    if split or EOS_TEXT not in text:
      assert target.decode(ids) == text, repr(text[:80])  # exact round trip, EOS skipped or not
    for row in (ids, [eos] + ids + [eos], ids[:7] + [eos] + ids[7:]):
      for skip in (False, True):
        assert tok.decode(row, skip_special_tokens=skip) == target.decode(
            row, skip_special_tokens=skip), (repr(text[:80]), skip)


def test_literal_special_token_text_policy(folder):
  """Shipped and specjax-trained folders encode the literal text '<|endoftext|>' as ordinary
  bytes, as the training corpus was encoded: EOS only ever comes from the model. A folder whose
  tokenizer does not split special tokens (transformers' default) maps it to the EOS id, in
  specjax as in transformers."""
  path, split = folder
  target = specjax.load_target(path)
  tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  ids = target.encode(f"a{EOS_TEXT}b")
  assert (0 in ids) == (not split)
  assert tok(f"a{EOS_TEXT}b").input_ids == ids
  assert target.decode(ids, skip_special_tokens=False) == f"a{EOS_TEXT}b"
  with open(f"{path}/tokenizer_config.json") as f:
    assert json.load(f)["split_special_tokens"] is split


# -- generation_config.json ----------------------------------------------------------------------

PROMPT = [5, 17, 42, 99, 3]
NEW = 20


def _hf_greedy(path) -> list[int]:
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, local_files_only=True).eval()
  with torch.no_grad():
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                         attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
  return out[0, len(PROMPT):].tolist()


def _specjax_greedy(path) -> list[int]:
  return specjax.generate(specjax.load_target(path, dtype="float32"), [PROMPT],
                          max_new_tokens=NEW).tokens[0]


@pytest.fixture
def checkpoint(hf_checkpoint, tmp_path):
  """A copy of the tiny random Qwen3 folder (no EOS anywhere) and transformers' greedy
  continuation of PROMPT from it, with the index of a token to use as EOS (the 5th or 6th
  generated, first of its kind, so both stop early and at the same place only if both read it)."""
  path = tmp_path / "ckpt"
  shutil.copytree(hf_checkpoint("qwen3_qknorm").path, path)
  free = _hf_greedy(path)
  assert len(free) == NEW
  stop = next(i for i in (5, 4, 6, 7, 3, 8) if free[i] not in free[:i])
  return path, free, stop


def _write_json(path, name, d):
  with open(path / name, "w") as f:
    json.dump(d, f)


@pytest.mark.parametrize("form", ["int", "list"])
def test_generate_stops_at_generation_config_eos_like_transformers(checkpoint, form):
  """eos_token_id in generation_config.json only (int, or a list whose first id never comes):
  specjax's default stop is transformers', token for token, EOS included."""
  path, free, stop = checkpoint
  unused = next(t for t in range(211) if t not in free)
  eos = free[stop] if form == "int" else [unused, free[stop]]
  _write_json(path, "generation_config.json", {"eos_token_id": eos, "bos_token_id": 1})
  target = specjax.load_target(path)
  assert target.generation == GenerationDefaults(
      eos_token_id=tuple(np.atleast_1d(eos).tolist()), bos_token_id=1)
  theirs = _hf_greedy(path)
  assert theirs == free[:stop + 1]
  assert _specjax_greedy(path) == theirs


def test_config_json_eos_counts_without_generation_config(checkpoint):
  """No generation_config.json: both stop at config.json's eos_token_id."""
  path, free, stop = checkpoint
  (path / "generation_config.json").unlink()
  with open(path / "config.json") as f:
    cfg = json.load(f)
  _write_json(path, "config.json", {**cfg, "eos_token_id": free[stop]})
  assert specjax.load_target(path).generation is None
  theirs = _hf_greedy(path)
  assert theirs == free[:stop + 1]
  assert _specjax_greedy(path) == theirs


def test_generation_config_without_eos_overrides_config_json(checkpoint):
  """A generation_config.json that names no EOS: transformers then ignores config.json's and
  runs to max_new_tokens; so does specjax."""
  path, free, stop = checkpoint
  with open(path / "config.json") as f:
    cfg = json.load(f)
  _write_json(path, "config.json", {**cfg, "eos_token_id": free[stop]})
  _write_json(path, "generation_config.json", {"bos_token_id": 1})
  assert specjax.load_target(path).config.eos_token_id == ()
  theirs = _hf_greedy(path)
  assert theirs == free
  assert _specjax_greedy(path) == theirs


def test_bad_generation_config_is_reported(checkpoint):
  path, free, stop = checkpoint
  _write_json(path, "generation_config.json", {"eos_token_id": [1, "x"]})
  with pytest.raises(ValueError, match="eos_token_id"):
    specjax.load_target(path)
  _write_json(path, "generation_config.json", {"eos_token_id": 10**6})
  with pytest.raises(ValueError, match="outside the vocabulary"):
    specjax.load_target(path)


# -- text --------------------------------------------------------------------------------------


def test_generated_text_skips_special_tokens_by_default():
  """`out.text` is `Target.decode` of the tokens without the EOS text, as transformers'
  `decode(..., skip_special_tokens=True)`; `skip_special_tokens=False` keeps it. The head's
  columns of EOS (id 0) and of the first new token of the free run are swapped, so the rigged
  target emits EOS exactly there."""
  cfg = tiny_targets.config(8192, num_layers=1).replace(eos_token_id=(0,), bos_token_id=0)
  target = tiny_targets.scaled_target(cfg, 0).replace(tokenizer=_embedded_tokenizer(True))
  prompt = "def f(x):\n"
  free = specjax.generate(target, [prompt], max_new_tokens=8, eos_token_id=[]).tokens[0]
  stop = next(i for i in range(1, 8) if free[i] not in free[:i] and 0 not in free[:i + 1])
  swap = np.arange(cfg.vocab_size)
  swap[[0, free[stop]]] = [free[stop], 0]
  rigged = target.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, x: x[:, swap] if "lm_head" in jax.tree_util.keystr(path) else x,
      target.params))
  out = specjax.generate(rigged, [prompt], max_new_tokens=8)
  assert out.tokens[0] == free[:stop] + [0]
  assert out.text[0] == target.decode(free[:stop]) == target.decode(out.tokens[0])
  assert EOS_TEXT not in out.text[0]
  assert target.decode(out.tokens[0], skip_special_tokens=False) == out.text[0] + EOS_TEXT


# -- round trip ----------------------------------------------------------------------------------


def test_generation_defaults_round_trip_through_save_hf(tmp_path):
  """save_hf writes what load_target read (eos list, bos, pad), transformers reads the same
  ids, and a second save is byte-identical."""
  cfg = tiny_targets.config(8192, num_layers=1)
  gen = GenerationDefaults(eos_token_id=(3, 0), bos_token_id=0, pad_token_id=0)
  target = specjax.Target.random(cfg, 0, _embedded_tokenizer(True)).replace(
      generation=gen, config=cfg.replace(eos_token_id=gen.eos_token_id))
  specjax.save_hf(target, tmp_path / "a")
  back = specjax.load_target(tmp_path / "a")
  assert back.generation == gen and back.config.eos_token_id == (3, 0)
  specjax.save_hf(back, tmp_path / "b")
  for name in ("config.json", "generation_config.json", "tokenizer_config.json",
               "tokenizer.json"):
    assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text(), name
  hf_gen = transformers.GenerationConfig.from_pretrained(tmp_path / "a", local_files_only=True)
  assert (hf_gen.eos_token_id, hf_gen.bos_token_id, hf_gen.pad_token_id) == ([3, 0], 0, 0)
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "a", local_files_only=True)
  # Id 3 is no special token: the tokenizer's EOS is the first EOS id that is one.
  assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 0, 0)


def test_target_without_generation_config_saves_its_config_ids(tmp_path):
  cfg = tiny_targets.config(211, num_layers=1).replace(eos_token_id=(7,), bos_token_id=1)
  specjax.save_hf(specjax.Target.random(cfg, 0), tmp_path)
  back = specjax.load_target(tmp_path)
  assert back.generation == GenerationDefaults(eos_token_id=(7,), bos_token_id=1)
  assert back.config == cfg
  assert hf_interop.read_generation_config(tmp_path) == back.generation
