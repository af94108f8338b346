"""Building blocks of the Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma decoder (Flax NNX).

Attribute names mirror the Hugging Face modules (`self_attn.q_proj`, `mlp.gate_proj`, ...) so the
checkpoint mapping in `specjax.interop` is mechanical. Numerics follow transformers: RMSNorm and
RoPE tables in float32, attention softmax in float32. Parameters are stored in `config.dtype`
and every activation is computed in `config.compute_dtype` (float32 unless asked otherwise: the
numerics policy of `ModelConfig`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sharding
from specjax.models.attention import AttentionFn
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig, RopeScaling

_INIT = nnx.initializers.normal(0.02)  # transformers' `initializer_range` default


def _linear(cfg: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, dtype=cfg.compute_jnp_dtype,
                    param_dtype=cfg.jnp_dtype, kernel_init=_INIT, rngs=rngs)


class RMSNorm(nnx.Module):
  """RMSNorm. `offset` (Gemma): the weight is stored as an offset from one (zeros init) and the
  product is taken in float32 before the cast back, as Gemma does; otherwise (Llama) the
  normalised input is cast first."""

  def __init__(self, dim: int, eps: float, dtype, offset: bool = False):
    self.weight = nnx.Param((jnp.zeros if offset else jnp.ones)((dim,), dtype))
    self.eps = eps
    self.offset = offset

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.offset:
      return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
    return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


def scale_embeddings(cfg: ModelConfig, x: jax.Array) -> jax.Array:
  """Gemma's sqrt(E) on the embeddings (a no-op elsewhere), the factor rounded to x's dtype as
  transformers rounds it to the activations'."""
  if not cfg.embed_scale:
    return x
  return x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """tanh soft-capping, tanh(x / cap) * cap (Gemma's order of operations); None: x."""
  return x if cap is None else jnp.tanh(x / cap) * cap


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
  """float32[D/2] inverse frequencies, with Llama 3's wavelength-dependent scaling if asked."""
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  if scaling.rope_type == "linear":
    return (inv_freq / scaling.factor).astype(np.float32)
  if scaling.rope_type == "llama3":
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
  return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """cos, sin: float32[B, T, D] for integer positions [B, T] (the halves repeated, as in HF)."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x: [B, T, H, D]; rotates pairs (i, i + D/2) — the `rotate_half` convention of HF."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
  return x * cos + rotated * sin


class Attention(nnx.Module):
  """Self-attention of the Llama family: q/k/v projections (with Qwen3's per-head q/k-norm) and
  RoPE, the attention itself (pluggable `attn_fn` over the KV cache), and the output projection.

  `in_features` is the width of the input the q/k/v projections read (default: E); a drafter
  layer that attends over a wider input (EAGLE-3: [embedding | feature], 2E) reuses this module.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, in_features: int | None = None):
    e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    d_in = e if in_features is None else in_features
    self.q_proj = _linear(cfg, d_in, h * d, cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, d_in, k * d, cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, d_in, k * d, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, h * d, e, cfg.o_bias, rngs)
    if cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's D features, before RoPE.
      self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.jnp_dtype, cfg.norm_offset)
      self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.jnp_dtype, cfg.norm_offset)
    self.qk_norm = cfg.qk_norm
    self.shape = (h, k, d)
    self.scale = cfg.attention_scale
    self.softcap = cfg.attn_logit_softcapping

  @property
  def sm_scale(self) -> float:
    return self.scale

  def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """x: [B, T, in_features] -> q [B, T, H, D], k, v [B, T, K, D], RoPE'd by (cos, sin)."""
    b, t, _ = x.shape
    h, kv, d = self.shape
    q = self.q_proj(x).reshape(b, t, h, d)
    k = self.k_proj(x).reshape(b, t, kv, d)
    v = self.v_proj(x).reshape(b, t, kv, d)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def output(self, attn_out: jax.Array) -> jax.Array:
    """[B, T, H, D] attention output -> [B, T, E]."""
    b, t = attn_out.shape[:2]
    return self.o_proj(attn_out.reshape(b, t, -1))

  def __call__(self, x, cos, sin, new_mask, cache: KVCache | None, layer: int,
               attn_fn: AttentionFn) -> tuple[jax.Array, KVCache | None]:
    # Soft-capping is passed only when set, so implementations without it keep working.
    kwargs = {} if self.softcap is None else {"softcap": self.softcap}
    q, k, v = self.project(x, cos, sin)
    q = sharding.constrain(q, sharding.HEADS_AXES)
    k, v = (sharding.constrain(a, sharding.KV_AXES) for a in (k, v))
    if cache is None:  # no prefix: attend among the new tokens only (training, full forward)
      out = attn_fn(q, k, v, None, new_mask, sm_scale=self.sm_scale, **kwargs)
    else:
      cache = cache.write(layer, k, v)
      out = attn_fn(q, cache.k[layer], cache.v[layer], cache.length, new_mask,
                    sm_scale=self.sm_scale, **kwargs)
    return self.output(out), cache


class MLP(nnx.Module):
  """SwiGLU, down(silu(gate(x)) * up(x)); with `hidden_act="gelu_pytorch_tanh"`, Gemma's GeGLU
  (gelu's tanh approximation in place of silu)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    e, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _linear(cfg, e, f, cfg.mlp_bias, rngs)
    self.up_proj = _linear(cfg, e, f, cfg.mlp_bias, rngs)
    self.down_proj = _linear(cfg, f, e, cfg.mlp_bias, rngs)
    self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

  def __call__(self, x: jax.Array) -> jax.Array:
    gate = self.gate_proj(x)
    gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
    return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm block. With `sandwich_norms` (Gemma) `post_attention_layernorm` norms the attention
  output before its residual add (not the MLP input, as in Llama), and two more norms wrap the
  MLP: `pre_feedforward_layernorm` on its input, `post_feedforward_layernorm` on its output."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    def norm():
      return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype, cfg.norm_offset)

    self.input_layernorm = norm()
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = norm()
    if cfg.sandwich_norms:
      self.pre_feedforward_layernorm = norm()
      self.post_feedforward_layernorm = norm()
    self.sandwich = cfg.sandwich_norms
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, cos, sin, new_mask, cache, layer, attn_fn):
    # The two sublayers are named scopes (with their norms and residual adds), which profilers
    # file kernels under (`specjax.lab.profiling.kernel_times`).
    with jax.named_scope("attention"):
      attn_out, cache = self.self_attn(self.input_layernorm(x), cos, sin, new_mask, cache, layer,
                                       attn_fn)
      if self.sandwich:
        x = x + self.post_attention_layernorm(attn_out)
      else:
        x = x + attn_out
    with jax.named_scope("mlp"):
      if self.sandwich:
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
      else:
        x = x + self.mlp(self.post_attention_layernorm(x))
    return x, cache
