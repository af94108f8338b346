"""What every published drafter layout shares: reading its folder, naming tensors, vocab maps.

A published drafter folder is a `config.json` (absent for some Medusa heads) and its weights:
`model.safetensors`, shards listed in `model.safetensors.index.json`, a format's own file name,
or a pickled torch file (`pytorch_model.bin`, `*.pt`), read only through torch
(`torch.load(weights_only=True)`) and only when torch is installed.

Tensors keep torch's layout on disk (linear weights `[out, in]`); `Checkpoint.linear` returns
a Flax kernel (`[in, out]`). Every tensor a conversion reads is marked used, and
`Checkpoint.check_all_used` names any the format did not expect, so a checkpoint of another
layout or with a renamed tensor is refused instead of half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from specjax import files
from specjax.drafters import learned
from specjax.interop.safetensors_file import SafetensorsFile
from specjax.models.config import ModelConfig

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SAFETENSORS = "model.safetensors"
TORCH_FILES = ("pytorch_model.bin",)


@dataclasses.dataclass(frozen=True)
class Converted:
  """A drafter folder (a published layout, or specjax's own: `io.read_drafter`) as a specjax
  family's network: what `Family.assemble` takes.

  method: the specjax family; net, params: its network config and params; d2t: int32[Vd] target
  id of each draft id; hidden_layers: the target hidden states it reads (specjax's indices: 0 the
  embeddings, i the output of layer i, L the final normed state); tree: default tree options;
  source: how the folder was read (format, files, layer-id convention), for the record.
  """

  method: str
  net: Any
  params: nnx.State
  d2t: np.ndarray
  hidden_layers: tuple[int, ...]
  tree: dict[str, Any]
  source: dict[str, Any]


def check_not_gemma_layers(m: ModelConfig, layout: str) -> None:
  """The published layouts hold Llama/Qwen layers, and a drafter shaped on a Gemma target has
  Gemma's (GeGLU, (1 + w) norms, its attention scale), which their config.json cannot say: a
  written file would load back as other maths. Raises ValueError for such a drafter."""
  if m.architecture in ("gemma2", "gemma3_text"):
    raise ValueError(f"the {layout} layout holds Llama/Qwen layers; this drafter's layers are "
                     f"shaped on a {m.architecture} target (GeGLU, Gemma's norms and attention "
                     "scale), which it cannot express")


def read_json(path: str, what: str = "JSON") -> dict[str, Any]:
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"corrupt {what} {path}: {e}") from None


def read_config(path: str) -> dict[str, Any] | None:
  file = os.path.join(path, CONFIG)
  return read_json(file, "drafter config") if os.path.isfile(file) else None


def weight_files(path: str, extra: Sequence[str] = ()) -> list[str]:
  """The weight files of a folder, in the order a loader tries them: the safetensors index's
  shards, `model.safetensors`, a format's own names (`extra`), then pickled torch files."""
  index = os.path.join(path, INDEX)
  if os.path.isfile(index):
    try:
      names = sorted(set(read_json(index, "weight index")["weight_map"].values()))
    except KeyError:
      raise ValueError(f"corrupt shard index {index}: no weight_map") from None
    for name in names:
      if not os.path.isfile(os.path.join(path, name)):
        raise ValueError(f"shard {name} listed in {index} is missing")
    return names
  for name in (SAFETENSORS, *extra, *TORCH_FILES):
    if os.path.isfile(os.path.join(path, name)):
      return [name]
  raise ValueError(f"no drafter weights in {path}: expected one of "
                   f"{[SAFETENSORS, INDEX, *extra, *TORCH_FILES]}")


def tensor_names(path: str, extra: Sequence[str] = ()) -> frozenset[str]:
  """The tensor names of a folder's weights (safetensors headers only; a torch pickle is
  loaded); empty when the folder has no weights."""
  try:
    files = weight_files(path, extra)
  except ValueError:
    return frozenset()
  names: set[str] = set()
  for name in files:
    file = os.path.join(path, name)
    names.update(SafetensorsFile(file).keys() if name.endswith(".safetensors")
                 else _torch_load(file))
  return frozenset(names)


def _torch_load(file: str) -> dict[str, np.ndarray]:
  try:
    import torch
  except ImportError:
    raise ValueError(
        f"{file} is a pickled torch checkpoint and torch is not installed: install torch, or "
        "convert it once to safetensors (safetensors.torch.save_file(torch.load(f), "
        "'model.safetensors'))") from None
  try:
    state = torch.load(file, map_location="cpu", weights_only=True)
  except Exception as e:  # noqa: BLE001 -- torch raises many kinds on a bad pickle
    raise ValueError(f"corrupt torch checkpoint {file}: {e}") from None
  if not isinstance(state, dict):
    raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
  out = {}
  for name, t in state.items():
    if not isinstance(t, torch.Tensor):
      raise ValueError(f"{file}: entry {name!r} is a {type(t).__name__}, not a tensor")
    t = t.detach().cpu()
    out[name] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
  return out


class Checkpoint:
  """The tensors of a published drafter folder, by name, each read once on demand."""

  def __init__(self, path: str | os.PathLike, extra_files: Sequence[str] = ()):
    self.path = os.fspath(path)
    if not os.path.isdir(self.path):
      raise ValueError(f"no drafter folder at {self.path}")
    self.config = read_config(self.path)
    self.files = weight_files(self.path, extra_files)
    self._tensors: dict[str, Callable[[], np.ndarray]] = {}
    self.shapes: dict[str, tuple[int, ...]] = {}
    self.used: set[str] = set()
    for name in self.files:
      file = os.path.join(self.path, name)
      if name.endswith(".safetensors"):
        self._open_safetensors(file)
      else:
        for key, value in _torch_load(file).items():
          self._tensors[key] = lambda v=value: v
          self.shapes[key] = tuple(value.shape)

  def _open_safetensors(self, file: str) -> None:
    handle = SafetensorsFile(file)

    def read(key):
      value = handle.read(key)
      # bfloat16 widened exactly to float32: numpy arithmetic on it stays exact
      return value.astype(np.float32) if value.dtype == ml_dtypes.bfloat16 else value

    for key in handle.keys():
      self.shapes[key] = handle.shapes[key]
      self._tensors[key] = lambda key=key: read(key)

  def __contains__(self, name: str) -> bool:
    return name in self._tensors

  def names(self) -> list[str]:
    return sorted(self._tensors)

  def get(self, name: str, shape: Sequence[int] | None = None) -> np.ndarray:
    """The tensor as stored (torch layout), its shape checked when `shape` is given."""
    if name not in self._tensors:
      raise ValueError(f"drafter checkpoint {self.path} lacks tensor {name!r}")
    if shape is not None and self.shapes[name] != tuple(shape):
      raise ValueError(f"tensor {name!r} of {self.path} has shape {self.shapes[name]}, "
                       f"expected {tuple(shape)}")
    self.used.add(name)
    return self._tensors[name]()

  def linear(self, name: str, d_in: int, d_out: int) -> np.ndarray:
    """A torch linear weight [out, in] as a Flax kernel [in, out]."""
    return self.get(name, (d_out, d_in)).T

  def check_all_used(self, ignored: Iterable[str] = ()) -> None:
    left = sorted(set(self._tensors) - self.used - set(ignored))
    if left:
      raise ValueError(f"drafter checkpoint {self.path} has tensors its format does not use: "
                       f"{left[:6]}{' ...' if len(left) > 6 else ''}")


def fill_params(abstract: nnx.State, read: Callable[[str, tuple[int, ...]], np.ndarray]
                ) -> nnx.State:
  """Params shaped as `abstract` (a family's network), each leaf `read(our_name, shape)` with
  our dotted name (e.g. "layer.q_proj.kernel") and the Flax shape it must have."""
  flat = []
  for key, var in nnx.to_flat_state(abstract):
    name = ".".join(str(k) for k in key)
    value = np.asarray(read(name, tuple(var.shape)))
    if value.shape != tuple(var.shape):  # a reader's own bug, not the checkpoint's
      raise AssertionError(f"{name}: read {value.shape}, expected {tuple(var.shape)}")
    flat.append((key, var.replace(jnp.asarray(value, dtype=var.dtype))))
  return nnx.from_flat_state(flat)


def torch_name(name: str) -> str:
  """A Flax leaf name as torch spells it: "...q_proj.kernel" -> "...q_proj.weight"."""
  return name.removesuffix(".kernel") + ".weight" if name.endswith(".kernel") else name


def renamed(ours: str, table: Sequence[tuple[str, str]], layout: str) -> str:
  """Our dotted name in a published layout: the first (our prefix, its prefix) of `table` that
  matches, then `torch_name`."""
  for mine, theirs in table:
    if ours.startswith(mine):
      return torch_name(theirs + ours[len(mine):])
  raise AssertionError(f"no {layout} name for {ours}")


def read_params(ckpt: Checkpoint, module: type, net, published_name: Callable[[str], str]
                ) -> nnx.State:
  """`module(net)`'s params from published tensors named by `published_name(our_name)`:
  linear weights transposed to Flax kernels, every shape checked."""
  from specjax.drafters import learned

  def read(name, shape):
    theirs = published_name(name)
    if name.endswith(".kernel"):
      return ckpt.linear(theirs, shape[0], shape[1])
    return ckpt.get(theirs, shape)

  return fill_params(learned.abstract_params(module, net), read)


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
  """Our dotted names -> float32 numpy arrays (bfloat16 widened: numpy has no bfloat16 file)."""
  out = {}
  for key, var in nnx.to_flat_state(params):
    x = np.asarray(jnp.asarray(var[...], jnp.float32))
    out[".".join(str(k) for k in key)] = x
  return out


def torch_layout(name: str, value: np.ndarray) -> np.ndarray:
  """A Flax kernel transposed to torch's [out, in]; anything else as it is."""
  return value.T if name.endswith(".kernel") else value


def write_weights(path: str, tensors: dict[str, np.ndarray], dtype: str | None,
                  name: str = SAFETENSORS) -> None:
  """`name` (default `model.safetensors`) of `tensors`; floating tensors cast to `dtype`
  ("bfloat16" goes through ml_dtypes, the numpy bfloat16 that safetensors writes); written
  atomically (`specjax.files`)."""
  out = {}
  for key, x in tensors.items():
    if dtype and np.issubdtype(x.dtype, np.floating):
      x = np.asarray(jnp.asarray(x).astype(dtype))
    out[key] = np.ascontiguousarray(x)
  files.save_safetensors(out, os.path.join(path, name), framework="numpy")


def write_json(path: str, name: str, data: dict[str, Any]) -> None:
  """`name` in folder `path`, atomically."""
  files.write_json(os.path.join(path, name), data, indent=2)


# -- draft vocabularies -----------------------------------------------------------------------


def d2t_from_offsets(offsets: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
  """EAGLE-3's `d2t` holds offsets (target id = i + d2t[i]); specjax keeps the ids."""
  offsets = np.asarray(offsets)
  if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
    raise ValueError(f"{where}: d2t must be a 1-D integer tensor, got {offsets.dtype} "
                     f"{offsets.shape}")
  ids = np.arange(offsets.size, dtype=np.int64) + offsets
  if ids.min() < 0 or ids.max() >= vocab_size:
    raise ValueError(f"{where}: d2t maps draft ids outside the target vocabulary "
                     f"[0, {vocab_size}) (offsets, target id = i + d2t[i])")
  if np.unique(ids).size != ids.size:
    raise ValueError(f"{where}: d2t maps two draft ids to one target id")
  return ids.astype(np.int32)


def offsets_from_d2t(d2t: np.ndarray) -> np.ndarray:
  return (np.asarray(d2t, np.int64) - np.arange(np.asarray(d2t).size, dtype=np.int64))


def t2d_of(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
  """bool[V]: which target ids the draft vocabulary holds."""
  mask = np.zeros(vocab_size, bool)
  mask[np.asarray(d2t)] = True
  return mask


# -- the draft network's shapes ----------------------------------------------------------------


def draft_model_config(config: dict[str, Any], target_cfg: ModelConfig, where: str
                       ) -> ModelConfig:
  """The draft layers' ModelConfig from a published config.json (a Llama- or Qwen-style model
  dict: its heads, head_dim, MLP width, RoPE, norms), checked against the target it drafts for:
  the same width (the drafter reads the target's hidden states and embedding)."""
  d = dict(config)
  if not d.get("model_type") or d.get("model_type") not in ("llama", "qwen2", "qwen3"):
    d["model_type"] = "llama"  # drafter architectures (e.g. LlamaForCausalLMEagle3) are llama
  d["architectures"] = []
  for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
    if key not in d:
      raise ValueError(f"{where}: config.json has no {key!r}")
  d.setdefault("num_hidden_layers", 1)
  d.setdefault("vocab_size", target_cfg.vocab_size)
  if d["hidden_size"] != target_cfg.hidden_size:
    raise ValueError(f"{where}: the drafter's hidden_size is {d['hidden_size']}, the target's "
                     f"{target_cfg.hidden_size}: it was made for another target")
  if "target_hidden_size" in d and d["target_hidden_size"] not in (None, d["hidden_size"]):
    raise ValueError(f"{where}: target_hidden_size {d['target_hidden_size']} differs from "
                     f"hidden_size {d['hidden_size']}; drafters narrower than their target "
                     "are not supported")
  cfg = ModelConfig.from_hf_dict(d)
  return cfg.replace(attention_impl="xla", dtype=target_cfg.dtype,
                     compute_dtype=target_cfg.dtype,
                     max_position_embeddings=max(cfg.max_position_embeddings,
                                                 target_cfg.max_position_embeddings))


def check_embedding(ckpt: Checkpoint, target, names=("embed_tokens.weight",)) -> None:
  """A saved embedding must be the target's: the head drafts with the target's own."""
  for name in names:
    if name in ckpt:
      cfg = target.config
      saved = np.asarray(ckpt.get(name, (cfg.vocab_size, cfg.hidden_size)), np.float32)
      mine = np.asarray(learned.target_embedding(cfg, target.params), np.float32)
      if not np.allclose(saved, mine, rtol=1e-2, atol=1e-2):
        raise ValueError(f"{ckpt.path}: its {name} differs from the target's embedding: the "
                         "drafter was made for another target")


def check_vocab(name: str, size: int, target_cfg: ModelConfig, where: str) -> None:
  if size != target_cfg.vocab_size:
    raise ValueError(f"{where}: {name} has {size} rows, the target's vocabulary "
                     f"{target_cfg.vocab_size}: it was made for another target")
