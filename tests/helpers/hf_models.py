"""Tiny random Hugging Face checkpoints built offline, for consistency tests with transformers."""

from __future__ import annotations

import os

import torch
import transformers

# name -> (HF config class, model class, kwargs). Vocab/hidden/layers kept tiny (penzai style).
_BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.3,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    "llama_mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama_gqa_tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True)),
    "llama_mqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama3_rope": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                  rope_theta=500000.0,
                                  rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=64))),
    "qwen2_bias": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3_qknorm": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   tie_word_embeddings=True)),
    # A window (48) shorter than the context but longer than every sequence the shared tests run
    # (<= 40 tokens): there it masks nothing, in transformers as in specjax.
    "mistral_window": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2,
                                       sliding_window=48)),
    # Fused qkv_proj / gate_up_proj in the checkpoint.
    "phi3_fused": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2)),
    # Gemma 2: both soft-caps low enough to bite (raw logits reach ~30, scores well past 5), an
    # attention scale that is not head_dim's, alternating sliding/full layers (window as above).
    "gemma2_softcap": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                      final_logit_softcapping=8.0, sliding_window=48)),
    # Gemma 3 text: q/k norms, mixed layers whose RoPE differ (local base 100; global base 1e4
    # with linear scaling x8).
    "gemma3_text_mixed": ("gemma3_text", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
        query_pre_attn_scalar=24, sliding_window=48,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e4),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
}
_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}


def build_hf_model(variant: str, seed: int = 0, **overrides):
  family, kwargs = VARIANTS[variant]
  config_cls, model_cls = _CLASSES[family]
  config = config_cls(**{**_BASE, **kwargs, **overrides})
  torch.manual_seed(seed)
  model = model_cls(config).eval()
  # Random norms and biases too, so a mis-mapped tensor cannot hide behind ones and zeros (Gemma's
  # norm weights are offsets from one: these scale by about 2).
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.2 * torch.randn_like(p))
  return model


def save_hf_model(variant: str, path: str | os.PathLike, seed: int = 0, **overrides):
  model = build_hf_model(variant, seed, **overrides)
  model.save_pretrained(path)
  return model
