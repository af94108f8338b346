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
}
_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
}


def build_hf_model(variant: str, seed: int = 0, **overrides):
  family, kwargs = VARIANTS[variant]
  config_cls, model_cls = _CLASSES[family]
  config = config_cls(**{**_BASE, **kwargs, **overrides})
  torch.manual_seed(seed)
  model = model_cls(config).eval()
  # Random norms and biases too, so a mis-mapped tensor cannot hide behind ones and zeros.
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
