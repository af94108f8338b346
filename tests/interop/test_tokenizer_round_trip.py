"""A tokenizer written by `save_hf` reads back in `transformers.AutoTokenizer` as specjax reads it,
for every family's folder: same ids, same text, no token added or rebuilt.

transformers picks the tokenizer class from config.json's `model_type` as well as from
`tokenizer_config.json`: for Qwen2 it always uses `Qwen2Tokenizer`, whose recipe (digits one by
one, NFC) would replace the folder's own pipeline (see `hf_tokenizer_config`). The second half
checks the other direction: a hub-style Qwen2 folder (`"tokenizer_class": "Qwen2Tokenizer"` next
to a `tokenizer.json` built to Qwen's recipe) gives specjax transformers' ids.
"""

from __future__ import annotations

import copy
import inspect
import json

import pytest

import specjax
from specjax import assets, data
from specjax.interop.tokenizer import REBUILT_TOKENIZER_MODEL_TYPES, load_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 8192  # the shipped tokenizer's
EOT = "<|endoftext|>"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"]

TEXTS = [
    "x = 12345 + 678", "2026-12-07", "3.14159265358979", "0x1F 1e-9 1_000_000 ٣٤٥ ①②",
    "a    b", "  leading", "trailing   ", "\ttab\t\tand \t mixed", "line\nline\r\nline\r\r\n\n\n",
    " \n \t \r\n ", "héllo wörld ✓ 日本語", "e\u0301 \u212b ﬁ ½ 🚀 \u200b", "\x00\x01\x7f",
    "def f(x):\n    return x**2  # ok\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "I'M DON'T it's we'LL", EOT, f"a{EOT}b", f"{EOT}{EOT}", f" {EOT} ", "<s>", "a<s>b",
    "<|endoftext|", "<|endof text|>",
]


def _texts() -> list[str]:
  import json.decoder
  return TEXTS + [inspect.getsource(json.decoder)]


def _family_config(arch: str) -> specjax.ModelConfig:
  """A one-layer target of family `arch` on the shipped tokenizer's vocabulary, written with the
  fields its transformers config needs (Qwen2's biases, Qwen3's and Gemma 3's q/k norms, Gemma's
  scale and layer types)."""
  extra: dict = {}
  if arch == "qwen2":
    extra = dict(qkv_bias=True)
  elif arch == "qwen3":
    extra = dict(qk_norm=True)
  elif arch in ("gemma2", "gemma3_text"):
    extra = dict(norm_offset=True, embed_scale=True, sandwich_norms=True,
                 hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=16,
                 layer_types=("full_attention",))
    if arch == "gemma3_text":
      extra.update(qk_norm=True, rope_local_theta=10000.0)
  return specjax.ModelConfig(
      architecture=arch, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256,
      eos_token_id=(0,), bos_token_id=0, **extra)


def _shipped(split_special_tokens: bool):
  tok = data.for_corpus(load_tokenizer(assets.TARGET_DIR))
  tok.encode_special_tokens = split_special_tokens
  return tok


def _without_endoftext():
  """The shipped tokenizer with its one special token renamed `<s>`: no `<|endoftext|>`, the
  token transformers' Qwen2 class would otherwise add by default."""
  from tokenizers import Tokenizer
  d = json.loads(load_tokenizer(assets.TARGET_DIR).to_str())
  d["added_tokens"][0]["content"] = "<s>"
  d["model"]["vocab"]["<s>"] = d["model"]["vocab"].pop(EOT)
  return Tokenizer.from_str(json.dumps(d))


TOKENIZERS = {"shipped": lambda: _shipped(True), "shipped_no_split": lambda: _shipped(False),
              "no_endoftext": _without_endoftext}
_PIPELINE = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model", "added_tokens")


@pytest.mark.parametrize("tokenizer", sorted(TOKENIZERS))
@pytest.mark.parametrize("arch", FAMILIES)
def test_auto_tokenizer_reads_save_hf_folder_as_specjax(arch, tokenizer, tmp_path):
  """The class is `PreTrainedTokenizerFast` (Qwen2: transformers' forced `Qwen2Tokenizer`) and its
  backend is `tokenizer.json` unchanged (no pipeline part rebuilt, no token added); every text
  encodes to specjax's ids with and without `add_special_tokens`, and any ids (the special
  token inserted too) decode to specjax's text, skipping special tokens or not."""
  specjax.save_hf(specjax.Target.random(_family_config(arch), 0, TOKENIZERS[tokenizer]()),
                  tmp_path)
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
  target = specjax.load_target(tmp_path)
  if arch in REBUILT_TOKENIZER_MODEL_TYPES:
    assert type(tok) is transformers.Qwen2Tokenizer
  else:
    assert type(tok) is transformers.PreTrainedTokenizerFast
  theirs, ours = json.loads(tok.backend_tokenizer.to_str()), json.loads(target.tokenizer.to_str())
  for part in _PIPELINE:
    assert theirs[part] == ours[part], part
  assert len(tok) == target.tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
  # Id 0 (`<|endoftext|>` or `<s>`) is BOS and EOS; no unknown or pad token, none defaulted.
  assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (
      0, 0, None, None)
  for text in _texts():
    ids = target.encode(text)
    assert tok(text, add_special_tokens=False).input_ids == ids, repr(text[:60])
    assert tok.encode(text) == ids, repr(text[:60])
    if target.tokenizer.encode_special_tokens or 0 not in ids:
      assert target.decode(ids, skip_special_tokens=False) == text, repr(text[:60])
    for row in (ids, [0] + ids + [0], ids[:3] + [0] + ids[3:]):
      for skip in (False, True):
        assert tok.decode(row, skip_special_tokens=skip) == target.decode(
            row, skip_special_tokens=skip), (repr(text[:60]), skip)


def test_literal_special_token_text_follows_split_special_tokens(tmp_path):
  """In a Qwen2 folder too, the literal special-token text is the special id only where the
  tokenizer does not split special tokens, in transformers as in specjax."""
  for split in (True, False):
    path = tmp_path / str(split)
    specjax.save_hf(specjax.Target.random(_family_config("qwen2"), 0, _shipped(split)), path)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = specjax.load_target(path).encode(f"a{EOT}b")
    assert (0 in ids) == (not split)
    assert tok(f"a{EOT}b").input_ids == ids


def test_only_forced_families_get_the_load_as_is_switch(tmp_path):
  """`trust_remote_code` (and null for the special-token roles without a token) appear only where
  transformers overrides `tokenizer_class`; no `auto_map` anywhere."""
  for arch in FAMILIES:
    specjax.save_hf(specjax.Target.random(_family_config(arch), 0, _without_endoftext()),
                    tmp_path / arch)
    d = json.loads((tmp_path / arch / "tokenizer_config.json").read_text())
    assert d["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "auto_map" not in d
    assert (d["bos_token"], d["eos_token"]) == ("<s>", "<s>")
    if arch in REBUILT_TOKENIZER_MODEL_TYPES:
      assert d["trust_remote_code"] is True
      assert (d["pad_token"], d["unk_token"]) == (None, None)
    else:
      assert not {"trust_remote_code", "pad_token", "unk_token"} & set(d), arch


# -- a hub-style Qwen2 folder ---------------------------------------------------------------------

def _qwen_recipe_tokenizer_json() -> dict:
  """The shipped vocabulary in a `tokenizer.json` built as hub Qwen2 ones are: NFC, Qwen's split
  (digits one by one), byte-level without its own regex, chat tokens added as special."""
  from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
  d = copy.deepcopy(json.loads(load_tokenizer(assets.TARGET_DIR).to_str()))
  byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                "use_regex": False}
  d["normalizer"] = {"type": "NFC"}
  d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated",
       "invert": False}, byte_level]}
  d["post_processor"], d["decoder"] = dict(byte_level), dict(byte_level)
  d["added_tokens"] += [{"id": VOCAB + i, "content": c, "single_word": False, "lstrip": False,
                         "rstrip": False, "normalized": False, "special": True}
                        for i, c in enumerate(["<|im_start|>", "<|im_end|>"])]
  return d


def _hub_tokenizer_config(tokenizer_json: dict) -> dict:
  return {"add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False,
          "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
          "pad_token": EOT, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
          "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
          "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                   for t in tokenizer_json["added_tokens"]}}


@pytest.mark.parametrize("resave", [False, True])
def test_hub_style_qwen2_folder_reads_alike(resave, tmp_path):
  """A Qwen2 folder as the hub ships it (`Qwen2Tokenizer` named, `tokenizer.json` to Qwen's
  recipe): specjax's ids and text are transformers', and still are once specjax re-saves it."""
  cfg = _family_config("qwen2").replace(vocab_size=VOCAB + 64, eos_token_id=(), bos_token_id=None)
  specjax.save_hf(specjax.Target.random(cfg, 0), tmp_path / "hub")
  tokenizer_json = _qwen_recipe_tokenizer_json()
  (tmp_path / "hub" / "tokenizer.json").write_text(json.dumps(tokenizer_json))
  (tmp_path / "hub" / "tokenizer_config.json").write_text(
      json.dumps(_hub_tokenizer_config(tokenizer_json)))
  path = tmp_path / "hub"
  if resave:
    specjax.save_hf(specjax.load_target(path), tmp_path / "resaved")
    path = tmp_path / "resaved"
  tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  target = specjax.load_target(path)
  assert type(tok) is transformers.Qwen2Tokenizer
  assert len(tok) == target.tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB + 2
  chat = "<|im_start|>user\nwhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n"
  for text in _texts() + [chat]:
    ids = target.encode(text)
    assert tok(text, add_special_tokens=False).input_ids == ids, repr(text[:60])
    for skip in (False, True):
      assert tok.decode(ids, skip_special_tokens=skip) == target.decode(
          ids, skip_special_tokens=skip), repr(text[:60])
  assert target.encode("x = 12345")[-5:] == [tok.convert_tokens_to_ids(c) for c in "12345"]
