"""Model configuration for the Llama family of decoders: Llama, Mistral, Qwen2, Qwen3 and Phi-3.

`ModelConfig` is frozen and hashable so it can be a static `jax.jit` argument. It is read from and
written to Hugging Face `config.json` dictionaries, accepting both the transformers 4.x spelling
(`rope_theta` + `rope_scaling`) and the 5.x spelling (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

import jax.numpy as jnp

from specjax.models.attention import attention_impls

Architecture = Literal["llama", "mistral", "qwen2", "qwen3", "phi3"]

# HF `architectures[0]` and `model_type` -> our family name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                   "phi3": "phi3"}
_ARCH_TO_HF = {v: k for k, v in _HF_ARCHITECTURES.items()}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. `rope_type` is one of "default", "llama3", "linear"."""

  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0  # llama3 only
  high_freq_factor: float = 4.0  # llama3 only
  original_max_position_embeddings: int = 8192  # llama3 only

  def __post_init__(self):
    if self.rope_type not in _ROPE_TYPES:
      raise ValueError(
          f"unsupported rope scaling type {self.rope_type!r}; supported: {_ROPE_TYPES}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3).

  The differences are flags: Qwen2 adds biases to q/k/v, Qwen3 adds RMSNorm on queries and keys
  per head and lets `head_dim` differ from `hidden_size / num_heads`. Mistral is Llama's math
  with an optional sliding window; Phi-3 is Llama's math whose checkpoints fuse q/k/v into one
  `qkv_proj` and gate/up into one `gate_up_proj` (split at load, fused again at save:
  `specjax.interop.hf`).

  Sliding windows (`sliding_window`: a query sees only keys fewer than that many positions back)
  are not implemented in the attention. Such a model is run only while every sequence fits in
  the window, where the window masks nothing and the model is exact: `context_length` is the
  smaller of the window and `max_position_embeddings`, and `check_window` raises past it.
  """

  architecture: Architecture = "llama"
  vocab_size: int = 32000
  hidden_size: int = 4096  # E
  intermediate_size: int = 11008
  num_layers: int = 32  # L
  num_heads: int = 32  # H
  num_kv_heads: int = 32  # K; == H is MHA, 1 is MQA, otherwise GQA
  head_dim: int = 128  # D
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None  # see the class docstring; None: full attention
  # Qwen2/Qwen3 with a window: layers with index >= this slide (the others attend fully). Kept so
  # that a saved config.json says what the checkpoint said; the limit above covers every layer.
  max_window_layers: int | None = None
  bos_token_id: int | None = None
  eos_token_id: tuple[int, ...] = ()
  dtype: str = "float32"  # parameter (storage) dtype: the checkpoint's, or what loading asks for
  # Activations, matmul outputs, logits and the KV cache. The numerics policy: float32 whatever the
  # storage dtype, so a bfloat16 checkpoint decodes as the float32 model of its own weights, whose
  # greedy tokens do not depend on batch composition or block length (README, "Numerics").
  # "bfloat16" trades that for speed and memory on accelerators.
  compute_dtype: str = "float32"
  attention_impl: str = "xla"  # a name registered in `specjax.models.attention`

  def __post_init__(self):
    if self.architecture not in _ARCH_TO_HF:
      raise ValueError(f"unknown architecture {self.architecture!r}; "
                       f"supported: {sorted(_ARCH_TO_HF)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    for name in ("dtype", "compute_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"unsupported {name} {getattr(self, name)!r}; supported: "
                         f"{sorted(_DTYPES)}")
    if self.attention_impl not in attention_impls():
      raise ValueError(f"unknown attention_impl {self.attention_impl!r}; "
                       f"registered: {attention_impls()}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "head_dim", "max_position_embeddings"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
    if self.sliding_window is not None and self.architecture == "llama":
      raise ValueError("a Llama config has no sliding_window (Mistral, Qwen2/Qwen3 and Phi-3 do)")
    if self.max_window_layers is not None and (
        self.architecture not in ("qwen2", "qwen3") or self.sliding_window is None):
      raise ValueError("max_window_layers applies only to a Qwen2/Qwen3 sliding window")

  @property
  def jnp_dtype(self):
    """The parameters' dtype."""
    return _DTYPES[self.dtype]

  @property
  def compute_jnp_dtype(self):
    """The activations' and KV cache's dtype."""
    return _DTYPES[self.compute_dtype]

  @property
  def hf_architecture(self) -> str:
    return _ARCH_TO_HF[self.architecture]

  @property
  def windowed(self) -> bool:
    """Whether a sliding window shorter than the context restricts attention."""
    return self.sliding_window is not None and self.sliding_window < self.max_position_embeddings

  @property
  def context_length(self) -> int:
    """The longest sequence specjax runs: `max_position_embeddings`, or the sliding window when
    that is shorter (specjax does not implement the window: within it, it masks nothing)."""
    return self.sliding_window if self.windowed else self.max_position_embeddings

  def check_window(self, n: int, what: str) -> None:
    """Raises ValueError when a sequence of n tokens (described by `what`) would reach past the
    sliding window, where specjax's full attention would differ from the model's."""
    if self.windowed and n > self.sliding_window:
      raise ValueError(
          f"{what} is {n} tokens, more than the sliding_window of {self.sliding_window} tokens "
          f"of this {self.hf_architecture}: specjax does not implement sliding-window "
          f"attention, so it runs this model only on sequences of at most {self.sliding_window} "
          "tokens (where the window masks nothing)")

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  # -- Hugging Face config.json ------------------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], **overrides) -> ModelConfig:
    """Builds a config from a parsed HF `config.json`; raises ValueError on what we cannot run."""
    arch = _architecture_of(d)
    num_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    head_dim = d.get("head_dim") or hidden // num_heads
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"unsupported hidden_act {act!r}; the Llama/Qwen family uses 'silu'")
    window, window_layers = _sliding_window_from_hf(arch, d)
    theta, scaling = _rope_from_hf(d)
    partial = (d.get("rope_parameters") or {}).get(
        "partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
      raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not "
                       "supported: specjax rotates every head dimension")
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    # Mistral and Phi-3 have no biases (transformers ignores `attention_bias` / `mlp_bias` there).
    biased = arch in ("llama", "qwen2", "qwen3")
    attention_bias = biased and bool(d.get("attention_bias", False))
    kwargs = dict(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama's and Qwen3's `attention_bias` covers q/k/v/o.
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=biased and bool(d.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_window=window,
        max_window_layers=window_layers,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos,
        dtype=_dtype_name(d.get("dtype") or d.get("torch_dtype") or "float32"),
    )
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json_file(cls, path: str | os.PathLike, **overrides) -> ModelConfig:
    with open(path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return cls.from_hf_dict(d, **overrides)

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` that transformers reads for this model (4.x and 5.x spellings both)."""
    rope_params: dict[str, Any] = {"rope_type": self.rope_scaling.rope_type,
                                   "rope_theta": self.rope_theta}
    if self.rope_scaling.rope_type != "default":
      rope_params["factor"] = self.rope_scaling.factor
    if self.rope_scaling.rope_type == "llama3":
      rope_params.update(
          low_freq_factor=self.rope_scaling.low_freq_factor,
          high_freq_factor=self.rope_scaling.high_freq_factor,
          original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings)
    legacy_scaling = None
    if self.rope_scaling.rope_type != "default":
      legacy_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    d: dict[str, Any] = {
        "architectures": [self.hf_architecture],
        "model_type": self.architecture,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope_params,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": (list(self.eos_token_id) if len(self.eos_token_id) > 1
                         else self.eos_token_id[0] if self.eos_token_id else None),
        "torch_dtype": self.dtype,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    qwen_window = dict(use_sliding_window=self.sliding_window is not None,
                       sliding_window=self.sliding_window)
    if self.max_window_layers is not None:
      qwen_window["max_window_layers"] = self.max_window_layers
    if self.architecture == "llama":
      d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
    elif self.architecture == "qwen3":
      d.update(attention_bias=self.qkv_bias, **qwen_window)
    elif self.architecture == "qwen2":
      d.update(qwen_window)
    else:  # mistral, phi3: the window applies to every layer when set
      # pad_token_id explicitly: Phi3Config's default (32000) would not fit a smaller vocabulary.
      d.update(sliding_window=self.sliding_window, pad_token_id=None)
    return d


def _architecture_of(d: dict[str, Any]) -> Architecture:
  for name in d.get("architectures") or ():
    if name in _HF_ARCHITECTURES:
      return _HF_ARCHITECTURES[name]  # type: ignore[return-value]
  if d.get("model_type") in _HF_MODEL_TYPES:
    return _HF_MODEL_TYPES[d["model_type"]]  # type: ignore[return-value]
  names = d.get("architectures") or []
  raise ValueError(
      f"unsupported architecture {', '.join(map(str, names)) or '(none named)'} "
      f"(architectures={names!r}, model_type={d.get('model_type')!r}); "
      f"supported: {', '.join(sorted(_HF_ARCHITECTURES))}")


def _sliding_window_from_hf(arch: str, d: dict[str, Any]) -> tuple[int | None, int | None]:
  """(sliding_window, max_window_layers) as transformers reads them for `arch`."""
  if arch in ("mistral", "phi3"):  # every layer slides when `sliding_window` is set
    return d.get("sliding_window"), None
  if arch == "llama":  # LlamaConfig has no window; refuse rather than silently ignore one
    if d.get("use_sliding_window"):
      raise ValueError("sliding-window attention (use_sliding_window=true) is not supported "
                       "for Llama")
    return None, None
  # Qwen2/Qwen3: only with use_sliding_window, and only on layers >= max_window_layers (or those
  # that `layer_types`, transformers 5.x, names "sliding_attention").
  window = d.get("sliding_window")
  if not d.get("use_sliding_window") or window is None:
    return None, None
  layers = d["num_hidden_layers"]
  first = d.get("max_window_layers")
  first = layers if first is None else first
  types = d.get("layer_types")
  if types is not None:
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    first = sliding[0] if sliding else layers
  return (None, None) if first >= layers else (int(window), int(first))


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, RopeScaling]:
  params = d.get("rope_parameters") or {}
  legacy = d.get("rope_scaling") or {}
  theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
  spec = params if params.get("rope_type", "default") != "default" else legacy
  rope_type = spec.get("rope_type", spec.get("type", "default"))
  if rope_type == "default":
    return float(theta), RopeScaling()
  fields = {f.name for f in dataclasses.fields(RopeScaling)}
  kwargs = {k: v for k, v in spec.items() if k in fields and k != "rope_type"}
  return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def _dtype_name(dtype: Any) -> str:
  name = str(dtype).removeprefix("torch.")
  if name not in _DTYPES:
    raise ValueError(f"unsupported checkpoint dtype {dtype!r}; supported: {sorted(_DTYPES)}")
  return name
