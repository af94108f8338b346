"""Hugging Face checkpoints <-> specjax params.

A folder holds `config.json`, the weights as `model.safetensors` or as shards listed in
`model.safetensors.index.json`, and optionally `generation_config.json`, `tokenizer.json` and
`tokenizer_config.json`; they are read as transformers reads them, so that the same folder
tokenizes, stops and decodes alike in both. Paths only: nothing is fetched from a hub. Tensor
names map mechanically onto the NNX param paths (the module attributes mirror transformers');
linear kernels are stored transposed (`[out, in]` in torch, `[in, out]` in Flax).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import assets, checks, config_utils, files, sharding
from specjax.interop.safetensors_file import SafetensorsFile
from specjax.interop.tokenizer import (
  TOKENIZER_CONFIG_FILE,
  TOKENIZER_FILE,
  apply_tokenizer_config,
  hf_tokenizer_config,
  load_tokenizer,
  read_tokenizer_config,
)
from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.target import GenerationDefaults, Target

_GENERATION = "generation_config.json"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(path: tuple) -> str:
  """NNX param path -> transformers tensor name."""
  *mods, leaf = (str(p) for p in path)
  leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
  prefix = [] if mods[0] == "lm_head" else ["model"]
  return ".".join(prefix + mods + [leaf])


def _is_kernel(path: tuple) -> bool:
  return str(path[-1]) == "kernel"


def _flat_params(params: nnx.State) -> dict[tuple, jax.Array]:
  return {path: leaf for path, leaf in nnx.to_flat_state(params)}


def to_hf_tensors(params: nnx.State, cfg: ModelConfig | None = None) -> dict[str, jax.Array]:
  """HF-named tensors of `params`, kernels transposed to torch's `[out, in]`; with the config of
  an architecture whose checkpoints fuse projections (Phi-3), those fused as it stores them."""
  out = {}
  for path, var in _flat_params(params).items():
    value = var[...] if hasattr(var, "get_value") or hasattr(var, "value") else var
    out[hf_name(path)] = jnp.transpose(value) if _is_kernel(path) else value
  if cfg is not None:
    for fused, parts in _fused_tensors(cfg).items():
      out[fused] = jnp.concatenate([out.pop(name) for name, _, _ in parts], axis=0)
  return out


# Phi-3 stores q/k/v as one `self_attn.qkv_proj` and gate/up as one `mlp.gate_up_proj`: the parts'
# rows concatenated in torch's [out, in] layout, in this order. specjax keeps them apart.
_FUSED = {"phi3": (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                   ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))}


def _fused_tensors(cfg: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
  """fused tensor name -> [(part name, first row, rows)] of `cfg`'s checkpoints."""
  h, k, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  rows = {"q_proj": h * d, "k_proj": k * d, "v_proj": k * d, "gate_proj": f, "up_proj": f}
  out = {}
  for i in range(cfg.num_layers):
    for module, fused, parts in _FUSED.get(cfg.architecture, ()):
      start, entries = 0, []
      for part in parts:
        entries.append((f"model.layers.{i}.{module}.{part}.weight", start, rows[part]))
        start += rows[part]
      out[f"model.layers.{i}.{module}.{fused}.weight"] = entries
  return out


# -- reading -----------------------------------------------------------------------------------


def _weight_files(path: str) -> tuple[list[str], dict[str, str] | None]:
  index = os.path.join(path, _INDEX)
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise ValueError(f"corrupt shard index {index}: {e}") from e
    files = sorted(set(weight_map.values()))
    for name in files:
      if not os.path.exists(os.path.join(path, name)):
        raise ValueError(f"shard {name} listed in {index} is missing")
    return files, weight_map
  if os.path.exists(os.path.join(path, _SINGLE)):
    return [_SINGLE], None
  raise ValueError(f"no weights in {path}: expected {_SINGLE} or {_INDEX}")


class _TensorSource(Protocol):
  """HF-named tensors, read whole or by slice (in the checkpoint's own, torch, layout)."""

  shapes: dict[str, tuple[int, ...]]

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    ...


class _DictSource:
  def __init__(self, tensors: dict[str, Any]):
    self._tensors = tensors
    self.shapes = {k: tuple(v.shape) for k, v in tensors.items()}

  def read(self, name, index=None):
    value = np.asarray(self._tensors[name])
    return value if index is None else value[index]


class _SafetensorsSource:
  """The tensors of a folder's safetensors file(s), headers read once and each tensor read on
  demand with plain reads (`SafetensorsFile`): no memory map holds the file's pages while the
  model is built, so a load peaks at the model plus one tensor."""

  def __init__(self, path: str):
    self.shapes, self._files = {}, {}
    files, _ = _weight_files(path)
    for name in files:
      handle = SafetensorsFile(os.path.join(path, name))
      for key in handle.keys():
        self.shapes[key] = handle.shapes[key]
        self._files[key] = handle

  def read(self, name, index=None):
    handle = self._files[name]
    if index is None:
      return handle.read(name)
    index = tuple(index)
    lead = index[0] if index and isinstance(index[0], slice) and index[0].step in (None, 1) \
        else None
    value = handle.read(name, lead)  # only the rows this shard needs
    return value[(slice(None),) + index[1:]] if lead is not None else value[index]


class _UnfusedSource:
  """A source whose fused tensors (`_FUSED`) read as their parts: each part a row range of the
  fused tensor, so a slice of a part is a slice of the fused tensor's bytes."""

  def __init__(self, cfg: ModelConfig, inner: _TensorSource):
    self._inner, self._parts = inner, {}
    self.shapes = dict(inner.shapes)
    for fused, parts in _fused_tensors(cfg).items():
      if fused not in inner.shapes:
        raise ValueError(f"missing tensor {fused!r} in checkpoint")
      width = cfg.hidden_size
      want = (sum(rows for _, _, rows in parts), width)
      if inner.shapes[fused] != want:
        raise ValueError(f"tensor {fused!r} has shape {inner.shapes[fused]}, expected {want} "
                         "for this config")
      del self.shapes[fused]
      for name, start, rows in parts:
        self._parts[name] = (fused, start, rows)
        self.shapes[name] = (rows, width)

  def read(self, name, index=None):
    if name not in self._parts:
      return self._inner.read(name, index)
    fused, start, rows = self._parts[name]
    index = (slice(None), slice(None)) if index is None else tuple(index)
    lo, hi, step = index[0].indices(rows)
    if step != 1:
      raise ValueError(f"strided read of {name!r}")
    return self._inner.read(fused, (slice(start + lo, start + hi),) + index[1:])


def _check_tensor_names(cfg: ModelConfig, source: _TensorSource, expected: set[str]) -> None:
  names = set(source.shapes)
  unexpected = sorted(names - expected - {"lm_head.weight"}
                      - {k for k in names if k.endswith(_IGNORED_SUFFIXES)})
  if unexpected:
    raise ValueError(f"checkpoint has tensors this {cfg.hf_architecture} config does not use: "
                     f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
  if "lm_head.weight" in names and "lm_head.weight" not in expected and (
      "model.embed_tokens.weight" not in names or not np.array_equal(
          source.read("lm_head.weight"), source.read("model.embed_tokens.weight"))):
    raise ValueError("config says tie_word_embeddings=true but lm_head.weight differs from "
                     "model.embed_tokens.weight")


def _params_from_source(cfg: ModelConfig, source: _TensorSource, mesh=None) -> nnx.State:
  """Params from HF-named tensors: every expected tensor present with its shape. Without a mesh
  each tensor becomes one array on the default device; on a mesh each device's shard is read
  from the source alone (`sharding.from_host_slices`), so no device and no host holds a whole
  copy of a sharded tensor."""
  if cfg.architecture in _FUSED:
    source = _UnfusedSource(cfg, source)
  abstract = decoder.abstract_params(cfg)
  _check_tensor_names(cfg, source, {hf_name(p) for p, _ in nnx.to_flat_state(abstract)})
  layout = None if mesh is None else {  # path -> NamedSharding (the Variable's value)
      p: v.get_value() for p, v in nnx.to_flat_state(sharding.param_shardings(cfg, abstract, mesh))}
  flat = []
  for path, var in nnx.to_flat_state(abstract):
    name = hf_name(path)
    if name not in source.shapes:
      raise ValueError(f"missing tensor {name!r} in checkpoint")
    kernel = _is_kernel(path)
    stored = source.shapes[name]
    if (tuple(reversed(stored)) if kernel else stored) != tuple(var.shape):
      raise ValueError(f"tensor {name!r} has shape {stored}, expected "
                       f"{tuple(reversed(var.shape)) if kernel else tuple(var.shape)}"
                       f" for this config")

    def read(index=None, name=name, kernel=kernel):
      if kernel:  # torch [out, in] on disk; the param is its transpose
        return source.read(name, None if index is None else index[::-1]).T
      return source.read(name, index)

    if layout is None:
      value = jnp.asarray(read(), dtype=var.dtype)
    else:
      value = sharding.from_host_slices(tuple(var.shape), var.dtype, layout[path], read)
    flat.append((path, var.replace(value)))
  return nnx.from_flat_state(flat)


def params_from_hf_tensors(cfg: ModelConfig, tensors: dict[str, Any], mesh=None
                           ) -> nnx.State:
  """Builds params from HF-named tensors; every expected tensor must be present with its shape.
  mesh: lay them out on it by the partition rules (`specjax.sharding`)."""
  return _params_from_source(cfg, _DictSource(tensors), mesh)


def read_generation_config(path: str | os.PathLike) -> GenerationDefaults | None:
  """The folder's `generation_config.json` special ids, None when it has none."""
  d = config_utils.read_json_object(os.path.join(os.fspath(path), _GENERATION))
  return None if d is None else GenerationDefaults.from_hf_dict(d)


def load_target(path: str | os.PathLike, dtype: str | None = None, *,
                compute_dtype: str = "float32", attention_impl: str = "xla",
                tokenizer: bool = True, mesh=None) -> Target:
  """Loads an HF-format folder (config.json + safetensors [+ tokenizer files]) as a `Target`.

  dtype: how the parameters are stored, "float32" or "bfloat16" (default: the checkpoint's own).
  compute_dtype: activations and KV cache (`ModelConfig.compute_dtype`): float32 by default, so
  greedy output does not depend on batch composition or block length; "bfloat16" for speed.
  EOS: as in transformers, a `generation_config.json` decides the ids `generate` stops at (all
  of them: none if it names none); config.json's count only without one. The target's
  `config.eos_token_id` holds the ids in force and `generation` what the file said.
  Tokenizer: `tokenizer.json` with `tokenizer_config.json`'s `split_special_tokens` (default
  false, as in transformers).
  mesh: a device mesh (or a spec such as 'dp=2,tp=4', or 'auto', `specjax.sharding`): each
  tensor is read slice by slice straight onto its shards (no whole copy per device), and the
  target runs there.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"load_target needs the path of a checkpoint folder, got "
                     f"{type(path).__name__}")
  path = os.fspath(path)
  config_file = os.path.join(path, "config.json")
  if os.path.isfile(path):
    raise ValueError(f"{path} is a file: load_target takes the checkpoint's folder "
                     f"({os.path.dirname(path) or '.'})")
  if not os.path.isdir(path):
    raise ValueError(f"checkpoint folder {path} does not exist")
  if not os.path.exists(config_file):
    raise ValueError(f"{path} has no config.json")
  overrides = {"attention_impl": attention_impl, "compute_dtype": compute_dtype}
  if dtype is not None:
    overrides["dtype"] = dtype
  cfg = ModelConfig.from_json_file(config_file, **overrides)
  generation = read_generation_config(path)
  if generation is not None:
    for e in generation.eos_token_id:
      if e >= cfg.vocab_size:
        raise ValueError(f"{os.path.join(path, _GENERATION)}: eos_token_id {e} outside the "
                         f"vocabulary [0, {cfg.vocab_size})")
    cfg = cfg.replace(eos_token_id=generation.eos_token_id)
  mesh = None if mesh is None else sharding.model_mesh(mesh, cfg)
  params = _params_from_source(cfg, _SafetensorsSource(path), mesh)
  tok = None
  if tokenizer and os.path.exists(os.path.join(path, TOKENIZER_FILE)):
    tok = apply_tokenizer_config(load_tokenizer(path, vocab_size=cfg.vocab_size),
                                 read_tokenizer_config(path))
  return Target(cfg, params, tok, generation, mesh, source=path)


# -- writing -----------------------------------------------------------------------------------


def save_hf(target: Target, path: str | os.PathLike, *, max_shard_bytes: int = 2 << 30,
            extra_files: dict[str, str] | None = None, overwrite_shipped: bool = False
            ) -> None:
  """Writes `target` as a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads.

  Weights above `max_shard_bytes` are split into shards with a `model.safetensors.index.json`.
  `generation_config.json` names the EOS ids `generate` stops at; with a tokenizer,
  `tokenizer.json` and the `tokenizer_config.json` under which `AutoTokenizer` matches it.

  The folder is written beside `path` and swapped in whole (`specjax.files.atomic_dir`): a
  failed export leaves the previous folder complete. Files of the previous folder that this
  export does not write are kept, but for its weights (a single file or shards and their index:
  never a stale one beside new ones). A folder inside the shipped assets needs
  `overwrite_shipped=True`; one holding a specjax drafter is refused (`files.check_export_over`).
  extra_files: more files of the folder by name (text), e.g. a README.md; never one of the
  files the export writes itself.
  """
  if not isinstance(target, Target):
    raise ValueError(f"save_hf saves a specjax.Target, got {type(target).__name__}")
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"save_hf needs a folder path, got {type(path).__name__}")
  path = os.fspath(path)
  max_shard_bytes = checks.integer("max_shard_bytes", max_shard_bytes, lo=1)
  for name, text in (extra_files or {}).items():
    if not isinstance(name, str) or os.path.basename(name) != name or name in (
        "", ".", "..", "config.json", _GENERATION, _SINGLE, _INDEX, TOKENIZER_FILE,
        TOKENIZER_CONFIG_FILE) or name.startswith("model-"):
      raise ValueError(f"extra_files name {name!r} must be a plain file name of the folder, not "
                       "a path or a file the export writes itself")
    if not isinstance(text, str):
      raise ValueError(f"extra_files[{name!r}] must be text (str), got {type(text).__name__}")
  assets.check_writable(path, overwrite_shipped, "the HF folder")
  files.check_export_over(path, files.MODEL, "save_hf")
  tensors = to_hf_tensors(target.params, target.config)
  shards = _shard(tensors, max_shard_bytes)
  with files.atomic_dir(path, drop=(_SINGLE, _INDEX, "model-*-of-*.safetensors")) as out:
    files.write_json(os.path.join(out, "config.json"), target.config.to_hf_dict(), indent=2)
    files.write_json(os.path.join(out, _GENERATION),
                     {**generation_defaults(target).to_hf_dict(), "do_sample": False}, indent=2)
    if len(shards) == 1:
      files.save_safetensors(shards[0], os.path.join(out, _SINGLE), metadata={"format": "pt"},
                             framework="flax")
    else:
      weight_map = {}
      for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        files.save_safetensors(shard, os.path.join(out, name), metadata={"format": "pt"},
                               framework="flax")
        weight_map.update({k: name for k in shard})
      total = sum(int(v.nbytes) for v in tensors.values())
      files.write_json(os.path.join(out, _INDEX),
                       {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    if target.tokenizer is not None:
      files.save_tokenizer(target.tokenizer, os.path.join(out, TOKENIZER_FILE))
      _write_tokenizer_config(target, out)
    for name, text in (extra_files or {}).items():
      files.write_text(os.path.join(out, name), text)


def generation_defaults(target: Target) -> GenerationDefaults:
  """What `save_hf` writes to `generation_config.json`: the EOS ids `generate` stops at, bos and
  pad as read (from the config when the target was not loaded with a generation config)."""
  gen = target.generation or GenerationDefaults(bos_token_id=target.config.bos_token_id)
  return dataclasses.replace(gen, eos_token_id=tuple(target.config.eos_token_id))


def write_tokenizer_config(target: Target, path: str | os.PathLike, *,
                           overwrite_shipped: bool = False) -> str:
  """Writes the `tokenizer_config.json` matching `target.tokenizer` into folder `path`
  (atomically; a folder inside the shipped assets needs `overwrite_shipped=True`)."""
  assets.check_writable(path, overwrite_shipped, "the tokenizer config's folder")
  return _write_tokenizer_config(target, path)


def _write_tokenizer_config(target: Target, path: str | os.PathLike) -> str:
  gen = generation_defaults(target)
  d = hf_tokenizer_config(target.tokenizer,
                          model_max_length=target.config.max_position_embeddings,
                          eos_token_ids=gen.eos_token_id, bos_token_id=gen.bos_token_id,
                          pad_token_id=gen.pad_token_id,
                          model_type=target.config.architecture)
  return files.write_text(os.path.join(os.fspath(path), TOKENIZER_CONFIG_FILE),
                          json.dumps(d, indent=2) + "\n")


def _shard(tensors: dict[str, jax.Array], max_bytes: int) -> list[dict[str, jax.Array]]:
  shards: list[dict[str, jax.Array]] = [{}]
  size = 0
  for name in sorted(tensors):
    nbytes = int(tensors[name].nbytes)
    if shards[-1] and size + nbytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = jnp.asarray(tensors[name])
    size += nbytes
  return shards
