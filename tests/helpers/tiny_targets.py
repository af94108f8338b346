"""Tiny random Qwen3 targets with structured (non-uniform) distributions, shared by the tests.

Random weights at the init scale 0.02 give near-uniform logits: greedy then rests on float-level
margins and sampling tests cannot see a bug that moves mass between tokens. Multiplying the 2-D
weights by `SCALE` gives logits whose law depends strongly on the position and the previous
token (tests/test_speculative.py checks it): a position-independent test target would hide
indexing bugs (every draft position reading the same row, say).

Configs are module constants so every test file builds the *same* configs: `generate` caches a
compiled program per (config, sampling, shapes, drafter structure), and tests that share a config,
a batch size, `pad_to` and `max_new_tokens` share the compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.models import decoder

SCALE = 16.0


def config(vocab_size: int, *, num_layers: int = 2, hidden_size: int = 32,
           max_position_embeddings: int = 256, num_heads: int = 2,
           num_kv_heads: int = 1) -> specjax.ModelConfig:
  """A tiny Qwen3 (GQA 2:1 by default, q/k-norm, untied head); eos_token_id empty: no stop by
  default."""
  return specjax.ModelConfig(
      architecture="qwen3", vocab_size=vocab_size, hidden_size=hidden_size,
      intermediate_size=2 * hidden_size, num_layers=num_layers, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=16, qk_norm=True,
      max_position_embeddings=max_position_embeddings)


def scaled_target(cfg: specjax.ModelConfig, seed: int, scale: float = SCALE) -> specjax.Target:
  """`Target.random` with every 2-D weight multiplied by `scale` (norm weights untouched)."""
  target = specjax.Target.random(cfg, seed)
  return target.replace(params=jax.tree.map(lambda x: x * scale if x.ndim == 2 else x,
                                            target.params))


def zero_last_layer(target: specjax.Target) -> specjax.Target:
  """The target with its last layer's output projections (o_proj, down_proj) zeroed.

  The last layer then adds exactly 0 to the residual stream, so the model truncated to its first
  L - 1 layers (plus the final norm and head) computes exactly the full model's logits.
  """
  last = f"['layers'][{target.config.num_layers - 1}]"

  def zero(path, x):
    name = jax.tree_util.keystr(path)
    return jnp.zeros_like(x) if last in name and ("o_proj" in name or "down_proj" in name) else x

  return target.replace(params=jax.tree_util.tree_map_with_path(zero, target.params))


_full_forward = jax.jit(decoder.full_forward, static_argnums=0)


def logits_of(target: specjax.Target, sequences) -> np.ndarray:
  """float32[B, T, V] logits of full (unpadded, equal-length) sequences, without a cache."""
  out = _full_forward(target.config, target.params, jnp.asarray(sequences, jnp.int32))
  return np.asarray(out.logits)


# The greedy target: vocab large enough for prompt lookup to be meaningful.
GREEDY_VOCAB = 96
GREEDY_CONFIG = config(GREEDY_VOCAB)
# A smaller independent draft LM of the same vocabulary (one layer).
DRAFT_CONFIG = config(GREEDY_VOCAB, num_layers=1)
# The sampling target: a vocabulary small enough to enumerate the joint law of 3 tokens.
SAMPLING_VOCAB = 8
SAMPLING_CONFIG = config(SAMPLING_VOCAB, max_position_embeddings=64)


# Targets that split over up to 8 devices: 8 query heads over 2 KV heads (the model axis then
# divides the KV heads at tp=2 and replicates them at tp=4 and 8), MLP and vocabulary divisible.
MESH_CONFIG = config(GREEDY_VOCAB, hidden_size=64, num_heads=8, num_kv_heads=2)
MESH_SAMPLING_CONFIG = config(SAMPLING_VOCAB, hidden_size=64, num_heads=8, num_kv_heads=2,
                              max_position_embeddings=64)


def mesh_target() -> specjax.Target:
  return scaled_target(MESH_CONFIG, seed=0)


def mesh_sampling_target() -> specjax.Target:
  return scaled_target(MESH_SAMPLING_CONFIG, seed=0)


def greedy_target() -> specjax.Target:
  return scaled_target(GREEDY_CONFIG, seed=0)


def draft_target() -> specjax.Target:
  return scaled_target(DRAFT_CONFIG, seed=1)


def sampling_target() -> specjax.Target:
  return scaled_target(SAMPLING_CONFIG, seed=0)


def sampling_draft() -> specjax.Target:
  """An independent random draft LM for the sampling target (same vocab, one layer)."""
  return scaled_target(config(SAMPLING_VOCAB, num_layers=1, max_position_embeddings=64), seed=1)


def learned_drafter(method: str, target: specjax.Target, seed: int = 0, noise: float = 0.3,
                    **tree_options):
  """An untrained learned drafter (`specjax.drafters.io.init_drafter`) whose matrices are
  perturbed by N(0, noise^2): Medusa and Hydra heads start at zero (they would only repeat the
  target's next-token guess) and EAGLE's at the init scale; random weights make every draft
  position propose something of its own, accepted or not."""
  from specjax.drafters import io
  drafter = io.init_drafter(method, target, seed=seed, **tree_options)
  leaves, treedef = jax.tree.flatten(drafter.params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + noise * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
            for x, k in zip(leaves, keys)]
  return drafter.replace(params=jax.tree.unflatten(treedef, leaves))
