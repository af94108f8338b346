"""Model configuration for the Llama family of decoders: Llama, Mistral, Qwen2, Qwen3, Phi-3,
and Gemma 2 / Gemma 3 (text).

`ModelConfig` is frozen and hashable so it can be a static `jax.jit` argument. It is read from and
written to Hugging Face `config.json` dictionaries, accepting both the transformers 4.x spelling
(`rope_theta` + `rope_scaling`) and the 5.x spelling (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from typing import Annotated, Any, Literal

import jax.numpy as jnp
import pydantic
from typing_extensions import Required, TypedDict  # pydantic needs these on Python < 3.12

from specjax import config_utils
from specjax.config_utils import Interval, NonNegInt, PosFloat, PosInt, config
from specjax.models.attention import attention_impls

Architecture = Literal["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"]

# HF `architectures[0]` and `model_type` -> our family name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                   "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3_text"}
_GEMMA = ("gemma2", "gemma3_text")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ARCH_TO_HF = {v: k for k, v in _HF_ARCHITECTURES.items()}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROPE_TYPES = ("default", "llama3", "linear")


@config
class RopeScaling:
  """RoPE frequency scaling. `rope_type` is one of "default", "llama3", "linear"."""

  rope_type: str = "default"
  factor: PosFloat = 1.0
  low_freq_factor: PosFloat = 1.0  # llama3 only
  high_freq_factor: PosFloat = 4.0  # llama3 only
  original_max_position_embeddings: PosInt = 8192  # llama3 only

  def __post_init__(self):
    if self.rope_type not in _ROPE_TYPES:
      raise ValueError(
          f"unsupported rope scaling type {self.rope_type!r}; supported: {_ROPE_TYPES}")


@config
class ModelConfig:
  """A decoder-only transformer of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3).

  The differences are flags: Qwen2 adds biases to q/k/v, Qwen3 adds RMSNorm on queries and keys
  per head and lets `head_dim` differ from `hidden_size / num_heads`. Mistral is Llama's math
  with an optional sliding window; Phi-3 is Llama's math whose checkpoints fuse q/k/v into one
  `qkv_proj` and gate/up into one `gate_up_proj` (split at load, fused again at save:
  `specjax.interop.hf`).

  Gemma 2 and Gemma 3 (text) are the same decoder with the flags of the block below on: RMSNorm
  scaling by (1 + w), embeddings scaled by sqrt(E), norms on each sublayer's output as well as its
  input, a GeGLU MLP, their own attention scale, and tanh soft-capping of attention scores
  (Gemma 2) and of the final logits. Gemma 3 adds per-head q/k norms (`qk_norm`) and gives its
  sliding layers their own RoPE base (`rope_local_theta`). `layer_types` keeps which layers
  slide, as the checkpoint says.

  Sliding windows (`sliding_window`: a query sees only keys fewer than that many positions back)
  are not implemented in the attention. Such a model is run only while every sequence fits in
  the window, where the window masks nothing and the model is exact: `context_length` is the
  smaller of the window and `max_position_embeddings`, and `check_window` raises past it.
  With `layer_types` (Gemma), only the layers typed "sliding_attention" slide, so the limit
  applies when there is at least one.
  """

  architecture: str = "llama"  # an `Architecture` (checked below, naming the supported ones)
  vocab_size: PosInt = 32000
  hidden_size: PosInt = 4096  # E
  intermediate_size: PosInt = 11008
  num_layers: PosInt = 32  # L
  num_heads: PosInt = 32  # H
  num_kv_heads: PosInt = 32  # K; == H is MHA, 1 is MQA, otherwise GQA
  head_dim: PosInt = 128  # D
  rms_norm_eps: PosFloat = 1e-6
  rope_theta: PosFloat = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  max_position_embeddings: PosInt = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  sliding_window: PosInt | None = None  # see the class docstring; None: full attention
  # Qwen2/Qwen3 with a window: layers with index >= this slide (the others attend fully). Kept so
  # that a saved config.json says what the checkpoint said; the limit above covers every layer.
  max_window_layers: NonNegInt | None = None
  # Gemma 2 / Gemma 3 (text); off for the other families.
  norm_offset: bool = False  # RMSNorm scales by (1 + w): w is stored as an offset (zeros init)
  embed_scale: bool = False  # the embeddings are multiplied by sqrt(hidden_size)
  sandwich_norms: bool = False  # also norm each sublayer's output, before its residual add
  hidden_act: str = "silu"  # the MLP gate's activation: "silu" (SwiGLU), "gelu_pytorch_tanh"
  query_pre_attn_scalar: PosFloat | None = None  # attention scale this ** -0.5 (None: head_dim's)
  attn_logit_softcapping: PosFloat | None = None  # scores -> tanh(scores / cap) * cap, pre-mask
  final_logit_softcapping: PosFloat | None = None  # logits -> tanh(logits / cap) * cap
  rope_local_theta: PosFloat | None = None  # RoPE base of "sliding_attention" layers (Gemma 3)
  layer_types: tuple[str, ...] | None = None  # per layer: "full_attention" | "sliding_attention"
  bos_token_id: NonNegInt | None = None
  eos_token_id: tuple[NonNegInt, ...] = ()
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
    if self.sliding_window is not None and self.architecture == "llama":
      raise ValueError("a Llama config has no sliding_window (Mistral, Qwen2/Qwen3 and Phi-3 do)")
    if self.max_window_layers is not None and (
        self.architecture not in ("qwen2", "qwen3") or self.sliding_window is None):
      raise ValueError("max_window_layers applies only to a Qwen2/Qwen3 sliding window")
    self._check_gemma_fields()

  def _check_gemma_fields(self):
    gemma = {"norm_offset": self.norm_offset, "embed_scale": self.embed_scale,
             "sandwich_norms": self.sandwich_norms,
             "hidden_act": self.hidden_act != "silu",
             "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
             "attn_logit_softcapping": self.attn_logit_softcapping is not None,
             "final_logit_softcapping": self.final_logit_softcapping is not None,
             "rope_local_theta": self.rope_local_theta is not None,
             "layer_types": self.layer_types is not None}
    if self.architecture not in _GEMMA and any(gemma.values()):
      # config.json has no place for them outside Gemma: a saved model would lose them.
      raise ValueError(f"{', '.join(k for k, v in gemma.items() if v)} apply only to Gemma "
                       f"(gemma2, gemma3_text), not {self.architecture}")
    if self.hidden_act not in _ACTIVATIONS:
      raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {_ACTIVATIONS}")
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(
          _LAYER_TYPES):
        raise ValueError(f"layer_types must name one of {_LAYER_TYPES} for each of the "
                         f"{self.num_layers} layers, got {self.layer_types}")
    if self.attn_logit_softcapping is not None and self.attention_impl == "pallas":
      raise ValueError("attention_impl='pallas' does not implement attention logit "
                       "soft-capping (attn_logit_softcapping, Gemma 2): use attention_impl='xla'")

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
    """Whether a sliding window shorter than the context restricts attention (of some layer)."""
    slides = self.layer_types is None or "sliding_attention" in self.layer_types
    return (slides and self.sliding_window is not None
            and self.sliding_window < self.max_position_embeddings)

  @property
  def attention_scale(self) -> float:
    """The factor on q.k: 1 / sqrt(head_dim), or Gemma's 1 / sqrt(query_pre_attn_scalar)."""
    scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
    return scalar ** -0.5

  def layer_rope(self, layer: int) -> tuple[float, RopeScaling]:
    """(theta, scaling) of a layer's RoPE: Gemma 3's sliding layers use their own base."""
    if (self.rope_local_theta is not None and self.layer_types is not None
        and self.layer_types[layer] == "sliding_attention"):
      return self.rope_local_theta, RopeScaling()
    return self.rope_theta, self.rope_scaling

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
    """A copy with `changes`. A copy of another depth (drafters shape their layers as the
    target's) drops `layer_types`, which describe the checkpoint's layers, unless given."""
    if changes.get("num_layers", self.num_layers) != self.num_layers:
      changes.setdefault("layer_types", None)
    return dataclasses.replace(self, **changes)

  # -- Hugging Face config.json ------------------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], *, where: str = "config.json", **overrides
                   ) -> ModelConfig:
    """Builds a config from a parsed HF `config.json`; raises ValueError on what we cannot run,
    and on a key of the wrong type or range (`HF_KEYS`), naming `where` (the file) and the key."""
    if not isinstance(d, dict):
      raise ValueError(f"{where} must hold a JSON object, got {type(d).__name__}")
    if "method" in d and "net" in d:
      raise ValueError(f"{where} is a specjax drafter's config, not a model's: load its folder "
                       "with specjax.drafters.io.load_drafter(folder, target)")
    try:
      arch = _architecture_of(d)
      check_hf_keys(d)
      vocab = d["vocab_size"]
      for key in ("bos_token_id", "eos_token_id"):
        ids = d.get(key)
        ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
        if any(i >= vocab for i in ids):
          raise ValueError(f"{key} {d[key]} is outside the vocabulary [0, {vocab})")
      return cls._from_checked_hf_dict(arch, d, **overrides)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None

  @classmethod
  def _from_checked_hf_dict(cls, arch: str, d: dict[str, Any], **overrides) -> ModelConfig:
    num_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    head_dim = d.get("head_dim") or hidden // num_heads
    gemma = arch in _GEMMA
    if gemma:  # transformers' Gemma reads `hidden_activation` (`hidden_act` is a Gemma 1 name)
      act = d.get("hidden_activation") or "gelu_pytorch_tanh"
      if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r} for {arch}; supported: "
                         "'gelu_pytorch_tanh'")
    else:
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
    # Mistral and Phi-3 have no biases (transformers ignores `attention_bias` / `mlp_bias` there);
    # Gemma's `attention_bias` covers q/k/v/o, and its MLP has none.
    biased = arch in ("llama", "qwen2", "qwen3")
    attention_bias = (biased or gemma) and bool(d.get("attention_bias", False))
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
    if gemma:
      kwargs.update(_gemma_from_hf(arch, d), o_bias=attention_bias, hidden_act=act)
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_json_file(cls, path: str | os.PathLike, **overrides) -> ModelConfig:
    try:
      with open(path, encoding="utf-8") as f:
        d = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
      raise ValueError(f"{path} is not UTF-8 text (a config.json is JSON): {e}") from None
    return cls.from_hf_dict(d, where=os.fspath(path), **overrides)

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` that transformers reads for this model (4.x and 5.x spellings both)."""
    rope_params = _rope_dict(self.rope_theta, self.rope_scaling)
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
    if self.architecture in _GEMMA:
      d.update(self._gemma_hf_dict())
    elif self.architecture == "llama":
      d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
    elif self.architecture == "qwen3":
      d.update(attention_bias=self.qkv_bias, **qwen_window)
    elif self.architecture == "qwen2":
      d.update(qwen_window)
    else:  # mistral, phi3: the window applies to every layer when set
      # pad_token_id explicitly: Phi3Config's default (32000) would not fit a smaller vocabulary.
      d.update(sliding_window=self.sliding_window, pad_token_id=None)
    return d

  def _gemma_hf_dict(self) -> dict[str, Any]:
    d: dict[str, Any] = dict(
        hidden_act=self.hidden_act, hidden_activation=self.hidden_act,
        attention_bias=self.qkv_bias,
        query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar),
        attn_logit_softcapping=self.attn_logit_softcapping,
        final_logit_softcapping=self.final_logit_softcapping,
        sliding_window=self.sliding_window, layer_types=list(self.layer_types or ()) or None,
        pad_token_id=None)  # explicitly: Gemma's default (0) is not this checkpoint's to claim
    if self.architecture == "gemma3_text":
      # Per layer type, as transformers 5.x nests them; 4.x reads rope_theta / rope_scaling
      # (already written, the full layers') and rope_local_base_freq.
      local = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
      d.update(rope_parameters={"full_attention": _rope_dict(self.rope_theta, self.rope_scaling),
                                "sliding_attention": _rope_dict(local, RopeScaling())},
               rope_local_base_freq=local)
    return d


# The config.json keys specjax reads, by type and range (the others are ignored, as transformers
# ignores keys its config class does not know). Wrong JSON types fail here, naming the key, rather
# than inside a trace: "64" is not a width, 2.0 is not a layer count, null is not an epsilon.
@pydantic.with_config(pydantic.ConfigDict(strict=True, allow_inf_nan=False))
class HF_KEYS(TypedDict, total=False):  # noqa: N801 (a schema, named as the file's keys)
  architectures: list[str] | None
  model_type: str | None
  vocab_size: Required[PosInt]
  hidden_size: Required[PosInt]
  intermediate_size: Required[PosInt]
  num_hidden_layers: Required[PosInt]
  num_attention_heads: Required[PosInt]
  num_key_value_heads: PosInt | None
  head_dim: PosInt | None
  hidden_act: str | None
  hidden_activation: str | None
  rms_norm_eps: PosFloat
  rope_theta: PosFloat
  rope_scaling: dict[str, Any] | None
  rope_parameters: dict[str, Any] | None
  partial_rotary_factor: Annotated[float, Interval(gt=0, le=1)] | None
  max_position_embeddings: PosInt
  tie_word_embeddings: bool | None
  attention_bias: bool | None
  mlp_bias: bool | None
  use_sliding_window: bool | None
  sliding_window: PosInt | None
  max_window_layers: NonNegInt | None
  sliding_window_pattern: PosInt
  layer_types: list[str] | None
  bos_token_id: NonNegInt | None
  eos_token_id: NonNegInt | list[NonNegInt] | None
  query_pre_attn_scalar: PosFloat | None
  attn_logit_softcapping: PosFloat | None
  final_logit_softcapping: PosFloat | None
  rope_local_base_freq: PosFloat
  use_bidirectional_attention: bool | None
  dtype: str | None
  torch_dtype: str | None


_HF_KEYS = pydantic.TypeAdapter(HF_KEYS)


def check_hf_keys(d: dict[str, Any]) -> None:
  """ValueError naming the key, its value and what it must be, for the keys of the config.json
  dict `d` that `HF_KEYS` refuses (a missing required key included)."""
  try:
    _HF_KEYS.validate_python(d)
  except pydantic.ValidationError as e:
    hints = typing.get_type_hints(HF_KEYS, include_extras=True)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for err in e.errors(include_url=False):
      by_key.setdefault(str(err["loc"][0]), []).append(err)
    problems = []
    for key, errs in list(by_key.items())[:3]:
      if errs[0]["type"] == "missing":
        problems.append(f"{key!r} is missing (a required key)")
        continue
      # A key of a union type fails once per member: quote the whole type instead.
      need = (config_utils.requirement(errs[0], hints[key]) if len(errs) == 1
              and len(errs[0]["loc"]) == 1 else f"must be {config_utils.type_name(hints[key])}")
      problems.append(f"{key!r} is {d[key]!r} ({type(d[key]).__name__}): it {need}")
    raise ValueError("; ".join(problems)) from None


def _int_if_whole(x: float | None) -> int | float | None:
  """transformers types Gemma's `query_pre_attn_scalar` as an int (its checks refuse 256.0)."""
  return int(x) if x is not None and float(x).is_integer() else x


def _rope_dict(theta: float, scaling: RopeScaling) -> dict[str, Any]:
  """transformers 5.x `rope_parameters` of one RoPE."""
  out: dict[str, Any] = {"rope_type": scaling.rope_type, "rope_theta": theta}
  if scaling.rope_type != "default":
    out["factor"] = scaling.factor
  if scaling.rope_type == "llama3":
    out.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
               original_max_position_embeddings=scaling.original_max_position_embeddings)
  return out


def _gemma_from_hf(arch: str, d: dict[str, Any]) -> dict[str, Any]:
  """The Gemma fields of a config.json, with transformers' defaults for absent keys."""
  if d.get("use_bidirectional_attention"):
    raise ValueError(f"use_bidirectional_attention is not supported ({arch}): specjax decodes "
                     "causally")
  layers = d["num_hidden_layers"]
  types = d.get("layer_types")
  if types is None:  # transformers' default pattern: every `period`-th layer attends fully
    period = 2 if arch == "gemma2" else d.get("sliding_window_pattern", 6)
    types = ["sliding_attention" if (i + 1) % period else "full_attention"
             for i in range(layers)]
  out = dict(
      norm_offset=True, embed_scale=True, sandwich_norms=True,
      query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
      sliding_window=d.get("sliding_window", 4096), layer_types=tuple(types),
      final_logit_softcapping=d.get("final_logit_softcapping",
                                    30.0 if arch == "gemma2" else None))
  if arch == "gemma2":
    out["attn_logit_softcapping"] = d.get("attn_logit_softcapping", 50.0)
    return out
  if d.get("attn_logit_softcapping") is not None:
    raise ValueError("attn_logit_softcapping is set in this gemma3_text config, but "
                     "transformers' Gemma 3 does not apply it: refusing rather than guessing")
  params = d.get("rope_parameters") or {}
  if "full_attention" in params or "sliding_attention" in params:  # transformers 5.x, nested
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    theta, scaling = _rope_from_hf({"rope_parameters": full}, 1_000_000.0)
    local_theta, local_scaling = _rope_from_hf({"rope_parameters": local}, 10_000.0)
  else:
    theta, scaling = _rope_from_hf(d, 1_000_000.0)
    local_theta, local_scaling = float(d.get("rope_local_base_freq", 10_000.0)), RopeScaling()
  if local_scaling != RopeScaling():
    raise ValueError(f"RoPE scaling of the sliding layers ({local_scaling.rope_type}) is not "
                     "supported for gemma3_text: only their base (rope_local_base_freq)")
  return dict(out, qk_norm=True, rope_theta=theta, rope_scaling=scaling,
              rope_local_theta=local_theta)


def _architecture_of(d: dict[str, Any]) -> Architecture:
  for name in d.get("architectures") or ():
    if name in _HF_ARCHITECTURES:
      return _HF_ARCHITECTURES[name]  # type: ignore[return-value]
  if d.get("architectures") and d.get("model_type") in _HF_MODEL_TYPES:
    # transformers builds the model `architectures` names: one specjax does not run, whatever
    # model_type says, is refused rather than run as another model.
    raise ValueError(f"architectures {d['architectures']!r} names no model specjax runs (its "
                     f"model_type is {d['model_type']!r}); supported: "
                     f"{', '.join(sorted(_HF_ARCHITECTURES))}")
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
  if arch in _GEMMA:  # per layer, with `layer_types`: `_gemma_from_hf`
    return None, None
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


def _rope_from_hf(d: dict[str, Any], default_theta: float = 10000.0
                  ) -> tuple[float, RopeScaling]:
  params = d.get("rope_parameters") or {}
  legacy = d.get("rope_scaling") or {}
  theta = params.get("rope_theta", d.get("rope_theta", default_theta))
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
