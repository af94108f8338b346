"""The shipped embedded default: what issue 'Embedded default' promises about it, checked.

The target and the draft LM under specjax/assets must load in transformers offline and agree with
specjax logit for logit, carry honest metadata (held-out loss below the bar, beside the unigram
baseline), fit the size budget, and their tokenizer must round-trip real code exactly.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import specjax
from specjax import assets
from specjax.models import decoder

_FOLDERS = {"target": assets.TARGET_DIR, "draft_lm": assets.DRAFT_LM_DIR}


def _metadata(name):
  with open(os.path.join(_FOLDERS[name], "metadata.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("name", sorted(_FOLDERS))
def test_transformers_loads_it_and_logits_match(name):
  """Qwen3ForCausalLM.from_pretrained reads the shipped folder offline; float32 logits on real
  code agree with specjax's within 1e-4 (the whole-model tolerance of
  tests/models/test_hf_consistency.py)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path = _FOLDERS[name]
  hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     local_files_only=True).eval()
  target = specjax.load_target(path, dtype="float32")
  ids = target.encode("import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n"
                      "        yield root, sorted(files)\n")
  with torch.no_grad():
    ref = hf(torch.tensor([ids])).logits.numpy()
  ours = np.asarray(decoder.full_forward(target.config, target.params,
                                         np.asarray([ids], np.int32)).logits)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_target_meets_the_bar():
  """>= 5M parameters, Qwen3 with GQA and q/k-norm, context >= 1024, >= 10M training tokens,
  held-out cross-entropy <= 2.8 nats/token and far below the unigram baseline."""
  meta = _metadata("target")
  cfg = specjax.ModelConfig.from_json_file(os.path.join(assets.TARGET_DIR, "config.json"))
  assert cfg.architecture == "qwen3" and cfg.qk_norm
  assert 1 < cfg.num_kv_heads < cfg.num_heads  # GQA
  assert cfg.max_position_embeddings >= 1024
  assert meta["num_params"] >= 5_000_000
  assert meta["tokens_seen"] >= 10_000_000
  assert meta["heldout_loss"] <= 2.8
  assert meta["unigram_baseline_loss"] > meta["heldout_loss"] + 2.0
  assert meta["corpus"]["python_version"]


def test_draft_lm_is_about_a_tenth():
  target, draft = _metadata("target"), _metadata("draft_lm")
  assert 0.05 <= draft["num_params"] / target["num_params"] <= 0.15
  assert draft["model"]["vocab_size"] == target["model"]["vocab_size"]
  with open(os.path.join(assets.TARGET_DIR, "tokenizer.json")) as a, \
       open(os.path.join(assets.DRAFT_LM_DIR, "tokenizer.json")) as b:
    assert a.read() == b.read()


def test_assets_fit_the_budget():
  total = sum(os.path.getsize(os.path.join(root, f))
              for root, _, files in os.walk(assets.ASSETS_DIR) for f in files
              if not f.endswith(".pyc"))
  assert total <= 40 * 2**20, f"assets take {total / 2**20:.1f} MiB"


def test_tokenizer_round_trips_every_heldout_file():
  """decode(encode(text)) == text exactly for every held-out stdlib file (code is whitespace-
  and byte-sensitive)."""
  from specjax import data
  from specjax.interop.tokenizer import load_tokenizer
  tok = data.for_corpus(load_tokenizer(assets.TARGET_DIR))
  heldout = data.load_stdlib_code("heldout")
  assert len(heldout) > 0
  for ex in heldout:
    assert tok.decode(tok.encode(ex["text"]).ids, skip_special_tokens=False) == ex["text"], \
        ex["path"]


def test_greedy_completion_of_a_humaneval_prompt_is_code():
  """The shipped target continues a HumanEval prompt with indented Python (a smoke test of the
  whole path: tokenizer -> generate -> decode)."""
  from specjax import data
  target = specjax.load_target(assets.TARGET_DIR, dtype="float32")
  prompt = data.load_humaneval()[0]["prompt"]
  out = specjax.generate(target, [prompt], max_new_tokens=32)
  assert len(out.tokens[0]) >= 1
  assert out.text[0].startswith(("    ", "\n"))


@pytest.mark.parametrize("name", sorted(_FOLDERS))
def test_tokenizer_config_is_what_save_hf_writes(name, tmp_path):
  """The shipped `tokenizer_config.json` (which makes `AutoTokenizer` run `tokenizer.json` as
  specjax does, see tests/interop/test_hf_fidelity.py) is the one `save_hf` writes for the
  folder's target with the corpus tokenizer, and `load_target` reads it back: literal special-
  token text is encoded as text, as in training."""
  from specjax import data
  from specjax.interop.hf import write_tokenizer_config
  from specjax.interop.tokenizer import load_tokenizer
  path = _FOLDERS[name]
  target = specjax.load_target(path)
  assert target.tokenizer.encode_special_tokens
  corpus = target.replace(tokenizer=data.for_corpus(load_tokenizer(path)))
  written = write_tokenizer_config(corpus, tmp_path)
  with open(written) as a, open(os.path.join(path, "tokenizer_config.json")) as b:
    assert a.read() == b.read()
