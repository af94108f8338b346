"""Targets beyond Llama/Qwen: Mistral (sliding window), Phi-3 (fused projections), Gemma 2 and
Gemma 3 text (soft-capping, sandwich norms, per-layer-type windows and RoPE), and the error for
everything else. Logit-level agreement with transformers for these variants is in
test_hf_consistency.py (they are among its variants); here: greedy decoding, the sliding-window
limit, the fused-tensor mapping, that each Gemma difference changes the logits, and the config
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import specjax
from specjax.drafters import build, learned
from specjax.interop import hf as hf_interop
from specjax.models import decoder
from specjax.models.config import ModelConfig, RopeScaling
from tests.helpers import hf_models

VOCAB = 211
WINDOW = 48  # hf_models "mistral_window"


def _hf_greedy(model, prompt, n):
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", ["mistral_window", "phi3_fused", "gemma2_softcap",
                                     "gemma3_text_mixed"])
def test_greedy_speculative_equals_autoregressive_equals_transformers(hf_checkpoint, variant):
  """Greedy tokens: transformers' generate == specjax autoregressive == specjax with prompt
  lookup (prompts with repeats, so drafts are accepted). The windowed runs (Mistral, Gemma) end
  exactly at the window (prompt + new tokens = 48): the longest that `generate` allows."""
  ckpt = hf_checkpoint(variant)
  rng = np.random.default_rng(0)
  motif = rng.integers(0, VOCAB, 6).tolist()
  prompts = [motif * 4 + [int(t) for t in rng.integers(0, VOCAB, 4)], motif * 2]
  new = WINDOW - len(prompts[0])
  ar = specjax.generate(ckpt.target, prompts, max_new_tokens=new)
  spec = specjax.generate(ckpt.target, prompts, max_new_tokens=new,
                          drafter=build("prompt_lookup", ckpt.target, num_tokens=3))
  assert spec.tokens == ar.tokens
  for prompt, tokens in zip(prompts, ar.tokens):
    assert tokens == _hf_greedy(ckpt.hf_model, prompt, new)


def test_mistral_window_is_loaded_and_enforced(hf_checkpoint):
  """The window is read from config.json and written back; past it transformers' attention
  differs from full attention (so running there would be wrong), and specjax refuses: generate,
  full_forward and training configs name the window."""
  ckpt = hf_checkpoint("mistral_window")
  cfg = ckpt.target.config
  assert (cfg.architecture, cfg.sliding_window, cfg.context_length) == ("mistral", WINDOW, WINDOW)
  assert cfg.to_hf_dict()["sliding_window"] == WINDOW
  # Past the window, the windowed reference and full attention disagree.
  tokens = np.random.default_rng(1).integers(0, VOCAB, (1, WINDOW + 8))
  with torch.no_grad():
    ref = ckpt.hf_model(torch.tensor(tokens)).logits[0].numpy()
  unwindowed = cfg.replace(sliding_window=None)
  ours = np.asarray(decoder.full_forward(unwindowed, ckpt.target.params,
                                         jnp.asarray(tokens, jnp.int32)).logits[0])
  assert np.abs(ours[:WINDOW] - ref[:WINDOW]).max() <= 1e-4
  assert np.abs(ours[WINDOW:] - ref[WINDOW:]).max() > 1e-2
  with pytest.raises(ValueError, match=r"prompt length 40 \+ max_new_tokens 9 is 49 tokens, "
                                       r"more than the sliding_window of 48"):
    specjax.generate(ckpt.target, [[1] * 40], max_new_tokens=9)
  with pytest.raises(ValueError, match=r"sequence length is 56 tokens.*sliding_window of 48"):
    decoder.full_forward(cfg, ckpt.target.params, jnp.asarray(tokens, jnp.int32))
  from specjax.train.optim import OptimConfig
  from specjax.train.target_lm import LMTrainConfig
  with pytest.raises(ValueError, match=r"training sequence length is 64.*sliding_window of 48"):
    LMTrainConfig(model=cfg, optim=OptimConfig(), seq_len=64)


def test_sliding_window_configs():
  """Mistral: a null window or one as long as the context restricts nothing. Qwen2/Qwen3: the
  window only with use_sliding_window and only on layers >= max_window_layers (as transformers
  reads them); it round-trips through to_hf_dict. Llama has none: use_sliding_window refuses."""
  base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
  for window in (None, 512, 4096):
    d = transformers.MistralConfig(**base, sliding_window=window).to_dict()
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.sliding_window == window and not cfg.windowed and cfg.context_length == 512
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
  for config_cls in (transformers.Qwen2Config, transformers.Qwen3Config):
    off = ModelConfig.from_hf_dict(config_cls(**base, sliding_window=32).to_dict())
    assert off.sliding_window is None and off.max_window_layers is None
    none_slide = config_cls(**base, use_sliding_window=True, sliding_window=32,
                            max_window_layers=4).to_dict()
    assert ModelConfig.from_hf_dict(none_slide).sliding_window is None
    d = config_cls(**base, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    cfg = ModelConfig.from_hf_dict(d.to_dict())
    assert (cfg.sliding_window, cfg.max_window_layers, cfg.context_length) == (32, 2, 32)
    back = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(back) == cfg
    assert config_cls(**{k: back[k] for k in ("use_sliding_window", "sliding_window",
                                              "max_window_layers", "num_hidden_layers")}
                      ).layer_types == d.layer_types
  llama = transformers.LlamaConfig(**base).to_dict()
  with pytest.raises(ValueError, match="sliding-window.*not supported for Llama"):
    ModelConfig.from_hf_dict(dict(llama, use_sliding_window=True))
  with pytest.raises(ValueError, match="Llama config has no sliding_window"):
    ModelConfig.from_hf_dict(llama).replace(sliding_window=32)
  with pytest.raises(ValueError, match=r"sliding_window must be an int >= 1 or none, got 0"):
    ModelConfig.from_hf_dict(d.to_dict()).replace(sliding_window=0)


GEMMA = ["gemma2_softcap", "gemma3_text_mixed"]


@pytest.mark.parametrize("variant", GEMMA)
def test_gemma_window_is_per_layer_and_enforced(hf_checkpoint, variant):
  """Gemma's window applies to its "sliding_attention" layers (`layer_types`, kept as read): past
  it transformers differs from full attention, and specjax refuses, as for Mistral. Without a
  sliding layer the window restricts nothing."""
  ckpt = hf_checkpoint(variant)
  cfg = ckpt.target.config
  assert cfg.layer_types == tuple(ckpt.hf_model.config.layer_types)
  assert (cfg.sliding_window, cfg.windowed, cfg.context_length) == (WINDOW, True, WINDOW)
  tokens = np.random.default_rng(1).integers(0, VOCAB, (1, WINDOW + 8))
  with torch.no_grad():
    ref = ckpt.hf_model(torch.tensor(tokens)).logits[0].numpy()
  ours = np.asarray(decoder.full_forward(cfg.replace(sliding_window=None), ckpt.target.params,
                                         jnp.asarray(tokens, jnp.int32)).logits[0])
  assert np.abs(ours[:WINDOW] - ref[:WINDOW]).max() <= 1e-4
  assert np.abs(ours[WINDOW:] - ref[WINDOW:]).max() > 1e-2
  with pytest.raises(ValueError, match=rf"is 49 tokens, more than the sliding_window of 48 "
                                       rf"tokens of this {cfg.hf_architecture}"):
    specjax.generate(ckpt.target, [[1] * 40], max_new_tokens=9)
  with pytest.raises(ValueError, match=r"sequence length is 56 tokens.*sliding_window of 48"):
    decoder.full_forward(cfg, ckpt.target.params, jnp.asarray(tokens, jnp.int32))
  full = cfg.replace(layer_types=("full_attention",) * cfg.num_layers)
  assert not full.windowed and full.context_length == 512


def test_gemma_on_a_mesh_decodes_as_unsharded(hf_checkpoint, tmp_path):
  """Gemma 2 split over a tp=2 mesh (heads, MLP and the vocabulary, so the final soft-cap runs
  on vocabulary shards): the same greedy tokens as on one device."""
  hf_models.save_hf_model("gemma2_softcap", tmp_path, vocab_size=212)
  target = specjax.load_target(tmp_path)
  prompts = [[5, 9, 2, 5, 9, 2, 7], [3, 1, 4, 1, 5]]
  ref = specjax.generate(target, prompts, max_new_tokens=8).tokens
  assert specjax.generate(target.on_mesh("dp=-1,tp=2"), prompts, max_new_tokens=8).tokens == ref


def _logits(cfg, params, tokens):
  return np.asarray(decoder.full_forward(cfg, params, tokens).logits)


def test_gemma_differences_each_change_the_logits(hf_checkpoint):
  """Each Gemma flag bites on these checkpoints (so the agreement with transformers tests it):
  the final cap bounds logits that would exceed it, and dropping either cap, the attention
  scale, Gemma 3's local RoPE base or its global RoPE scaling moves the logits. The target
  pieces drafters read agree with the decoder: `learned.embed` is hidden state 0 (scaled) and
  `decoder.lm_head` of the final state gives the capped logits."""
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 40)), jnp.int32)
  g2 = hf_checkpoint("gemma2_softcap").target
  cfg, params = g2.config, g2.params
  out = decoder.full_forward(cfg, params, tokens, hidden_layers=(0, cfg.num_layers))
  capped = np.asarray(out.logits)
  raw = _logits(cfg.replace(final_logit_softcapping=None), params, tokens)
  assert np.abs(capped).max() < 8.0 < np.abs(raw).max()
  for change in (dict(final_logit_softcapping=None), dict(attn_logit_softcapping=None),
                 dict(query_pre_attn_scalar=None)):
    assert np.abs(_logits(cfg.replace(**change), params, tokens) - capped).max() > 0.1, change
  np.testing.assert_array_equal(np.asarray(learned.embed(cfg, params, tokens)),
                                np.asarray(out.hidden[0]))
  assert not np.allclose(np.asarray(out.hidden[0]),
                         np.asarray(learned.target_embedding(cfg, params))[np.asarray(tokens)])
  np.testing.assert_allclose(np.asarray(decoder.lm_head(cfg, params, out.hidden[1])), capped,
                             atol=1e-5, rtol=0)
  g3 = hf_checkpoint("gemma3_text_mixed").target
  cfg, params = g3.config, g3.params
  base = _logits(cfg, params, tokens)
  for change in (dict(rope_local_theta=None), dict(rope_scaling=RopeScaling()),
                 dict(query_pre_attn_scalar=None)):
    assert np.abs(_logits(cfg.replace(**change), params, tokens) - base).max() > 0.1, change


def _gemma_dict(variant):
  return hf_models.build_hf_model(variant).config.to_dict()


def test_gemma_configs_round_trip_and_refuse_what_they_cannot_run():
  """to_hf_dict writes what transformers reads back as the same config (layer types, both RoPEs,
  caps, attention scale), and from_hf_dict reads it back equal; an old config without
  `layer_types` gets transformers' default pattern. Refused: bidirectional attention, Gemma 3
  attention soft-capping (transformers ignores it), RoPE scaling on Gemma 3's sliding layers,
  the Pallas attention with soft-capping, Gemma flags on another family."""
  for variant, config_cls in (("gemma2_softcap", transformers.Gemma2Config),
                              ("gemma3_text_mixed", transformers.Gemma3TextConfig)):
    d = _gemma_dict(variant)
    cfg = ModelConfig.from_hf_dict(d)
    back = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(back) == cfg
    hf = config_cls(**{k: v for k, v in back.items() if k != "torch_dtype"})
    for key in ("layer_types", "rope_parameters", "sliding_window", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
                "tie_word_embeddings"):
      assert getattr(hf, key) == d[key], key
    for n in (4, 7):
      old = {k: v for k, v in d.items() if k != "layer_types"}
      old.update(num_hidden_layers=n, sliding_window_pattern=3)
      want = config_cls(**{k: v for k, v in old.items() if k not in ("dtype",)}).layer_types
      assert ModelConfig.from_hf_dict(old).layer_types == tuple(want)
  g2, g3 = _gemma_dict("gemma2_softcap"), _gemma_dict("gemma3_text_mixed")
  with pytest.raises(ValueError, match="use_bidirectional_attention is not supported"):
    ModelConfig.from_hf_dict(dict(g3, use_bidirectional_attention=True))
  with pytest.raises(ValueError, match="transformers' Gemma 3 does not apply it"):
    ModelConfig.from_hf_dict(dict(g3, attn_logit_softcapping=50.0))
  local_scaled = dict(g3, rope_parameters=dict(
      g3["rope_parameters"], sliding_attention=dict(rope_type="linear", factor=2.0,
                                                    rope_theta=100.0)))
  with pytest.raises(ValueError, match="RoPE scaling of the sliding layers"):
    ModelConfig.from_hf_dict(local_scaled)
  with pytest.raises(ValueError, match="unsupported hidden_activation 'gelu'"):
    ModelConfig.from_hf_dict(dict(g2, hidden_activation="gelu"))
  with pytest.raises(ValueError, match=r"attention_impl='pallas' does not implement attention "
                                       r"logit soft-capping"):
    ModelConfig.from_hf_dict(g2, attention_impl="pallas")
  assert ModelConfig.from_hf_dict(g3, attention_impl="pallas").attention_impl == "pallas"
  with pytest.raises(ValueError, match="final_logit_softcapping apply only to Gemma"):
    ModelConfig(final_logit_softcapping=30.0)
  with pytest.raises(ValueError, match="layer_types must name one of"):
    ModelConfig.from_hf_dict(g2).replace(layer_types=("full_attention",))
  # A copy of another depth (drafter layers shaped as the target's) drops the layer types.
  assert ModelConfig.from_hf_dict(g3).replace(num_layers=1).layer_types is None


@pytest.mark.parametrize("variant, method", [("gemma2_softcap", "eagle"),
                                             ("gemma3_text_mixed", "dflash")])
def test_learned_drafters_on_gemma_are_lossless(hf_checkpoint, variant, method, tmp_path):
  """A randomly initialised learned drafter on a Gemma target (its embeddings read through
  `learned.embed`, scaled as the target's) drafts, and greedy output equals autoregressive. The
  published layouts, which hold Llama/Qwen layers, refuse to write its Gemma-shaped layers."""
  from specjax.drafters import formats
  from tests.helpers import tiny_targets
  target = hf_checkpoint(variant).target
  rng = np.random.default_rng(3)
  motif = rng.integers(0, VOCAB, 5).tolist()
  prompts = [motif * 3 + [int(t) for t in rng.integers(0, VOCAB, 3)], motif * 2]
  ar = specjax.generate(target, prompts, max_new_tokens=16)
  drafter = tiny_targets.learned_drafter(method, target)
  assert specjax.generate(target, prompts, max_new_tokens=16, drafter=drafter).tokens == ar.tokens
  with pytest.raises(ValueError, match=rf"the {method} layout holds Llama/Qwen layers"):
    formats.write(tmp_path, drafter, target, method)


def test_phi3_fused_tensors_split_at_load_and_fuse_at_save(hf_checkpoint, tmp_path):
  """Phi-3's qkv_proj rows are [q | k | v] and gate_up_proj's [gate | up]: the loaded q/k/v and
  gate/up kernels are those row ranges (transposed); to_hf_tensors with the config fuses them
  back bit for bit; a sharded load (tp=2, slices of the fused tensors) equals the plain one."""
  ckpt = hf_checkpoint("phi3_fused")
  cfg, params = ckpt.target.config, ckpt.target.params
  state = ckpt.hf_model.state_dict()
  attn = params["layers"][1]["self_attn"]
  qkv = state["model.layers.1.self_attn.qkv_proj.weight"].numpy()
  q, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  np.testing.assert_array_equal(np.asarray(attn["q_proj"]["kernel"][...]), qkv[:q].T)
  np.testing.assert_array_equal(np.asarray(attn["k_proj"]["kernel"][...]), qkv[q:q + k].T)
  np.testing.assert_array_equal(np.asarray(attn["v_proj"]["kernel"][...]), qkv[q + k:].T)
  gate_up = state["model.layers.1.mlp.gate_up_proj.weight"].numpy()
  mlp = params["layers"][1]["mlp"]
  f = cfg.intermediate_size
  np.testing.assert_array_equal(np.asarray(mlp["gate_proj"]["kernel"][...]), gate_up[:f].T)
  np.testing.assert_array_equal(np.asarray(mlp["up_proj"]["kernel"][...]), gate_up[f:].T)
  tensors = hf_interop.to_hf_tensors(params, cfg)
  assert tensors.keys() == state.keys()
  for name, value in state.items():
    np.testing.assert_array_equal(np.asarray(tensors[name]), value.numpy(), err_msg=name)
  hf_models.save_hf_model("phi3_fused", tmp_path, vocab_size=212)  # tp=2 splits the vocabulary
  plain, sharded = specjax.load_target(tmp_path), specjax.load_target(tmp_path, mesh="dp=-1,tp=2")
  assert sharded.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...].sharding.spec[1]
  for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(plain.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A Llama-named checkpoint declared Phi-3 names the fused tensor it lacks.
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.self_attn\.qkv_proj"):
    hf_interop.params_from_hf_tensors(cfg, hf_interop.to_hf_tensors(params))
  bad = dict(tensors)
  bad["model.layers.0.mlp.gate_up_proj.weight"] = np.zeros((2 * f - 1, cfg.hidden_size))
  with pytest.raises(ValueError, match=r"gate_up_proj\.weight' has shape \(191, 64\), expected"):
    hf_interop.params_from_hf_tensors(cfg, bad)


_PHI3 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=VOCAB,
             hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


@pytest.mark.parametrize("changes, message", [
    (dict(partial_rotary_factor=0.75), r"partial rotary .*partial_rotary_factor=0\.75"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     r"partial_rotary_factor=0\.5"),
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8)),
     r"unsupported rope scaling type 'longrope'"),
    (dict(rope_scaling=dict(type="su", short_factor=[1.0] * 8, long_factor=[2.0] * 8)),
     r"unsupported rope scaling type 'su'"),
], ids=["partial_rotary", "partial_rotary_v5", "longrope", "su"])
def test_phi3_rope_variants_that_do_not_map_exactly_are_refused(changes, message):
  assert ModelConfig.from_hf_dict(_PHI3).architecture == "phi3"
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_hf_dict(dict(_PHI3, **changes))


@pytest.mark.parametrize("arch, model_type", [
    ("GPT2LMHeadModel", "gpt2"), ("FalconForCausalLM", "falcon"),
    ("GemmaForCausalLM", "gemma"), ("Gemma3ForConditionalGeneration", "gemma3"),
])
def test_unsupported_architectures_are_named(arch, model_type):
  """Any other architecture (Gemma 1 and the multimodal Gemma 3 too): ValueError naming it and
  listing the supported ones."""
  d = dict(_PHI3, architectures=[arch], model_type=model_type)
  supported = ("Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
               "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")
  with pytest.raises(ValueError, match=rf"unsupported architecture {arch} .*'{model_type}'.*"
                                       rf"supported: {supported}$"):
    ModelConfig.from_hf_dict(d)
  with pytest.raises(ValueError, match=r"unsupported architecture \(none named\)"):
    ModelConfig.from_hf_dict(dict(d, architectures=None))
