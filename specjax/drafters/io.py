"""Saving and loading learned drafters: a folder of `config.json` + `model.safetensors`.

  config.json        {"method", "net" (the family's network config), "hidden_layers" (target
                     hidden-state indices the drafter reads: required metadata, never guessed),
                     "draft_vocab_size", "target" (vocab_size, hidden_size, num_layers,
                     architecture, tokenizer hash it was trained against), and optionally
                     "tree": default tree options (tuned for this drafter; callers override)}
  model.safetensors  the network's params by dotted path, and `d2t` (int32[Vd]: the target id
                     of each draft id; explicit ids, not EAGLE's offsets)
  metadata.json      optional: how it was trained (steps, wall time, held-out agreement)

`load_drafter(path, target, **tree_options)` refuses a drafter made for a target of another
vocabulary, hidden size or depth, and names missing or corrupt files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import pydantic
from flax import nnx
from safetensors import SafetensorError, safe_open
from typing_extensions import Required, TypedDict  # pydantic needs these on Python < 3.12

from specjax import assets, checks, config_utils, files, sharding
from specjax.config_utils import NonNegInt, PosInt
from specjax.drafters import formats, learned, registry
from specjax.interop.tokenizer import tokenizer_fingerprint
from specjax.models.config import ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
METADATA = "metadata.json"


def register_family(fam: learned.Family) -> learned.Family:
  """Registers a learned family: its drafter builder (`specjax.drafters.build(name, target,
  path=None, **tree_options)`, usable when a drafter was shipped for the target) and the family
  object that training, loading, tree tuning and comparison look up by name."""
  for attr in ("name", "module", "config_cls"):
    if not hasattr(fam, attr):
      raise ValueError(f"learned family {type(fam).__name__} does not set {attr!r}")

  def build(target, *, path: str | None = None, **tree_options):
    return load_drafter(path or asset_dir(fam.name), target, method=fam.name, **tree_options)

  build.__doc__ = (f"path: a {fam.name} folder (default: the one shipped for the embedded "
                   "target); tree_options override its default tree.")
  registry.register(fam.name, usable=shipped_usable(fam.name), description=fam.description,
                    family=fam)(build)
  return fam


family = registry.family


# The network config's JSON form: its fields, a nested ModelConfig as its HF dict.
_NET_CODECS = config_utils.hf_codecs(ModelConfig)


def save_drafter(path: str | os.PathLike, method: str, net, params: nnx.State, d2t,
                 target_cfg: ModelConfig, tokenizer=None, metadata: dict[str, Any] | None = None,
                 dtype: str | None = None, hidden_layers: Sequence[int] | None = None, *,
                 overwrite_shipped: bool = False) -> None:
  """Writes the folder; `dtype` (e.g. "bfloat16") casts the stored weights; the target's
  tokenizer, when given, is fingerprinted so a drafter is never paired with other token ids;
  `hidden_layers` are the target states the drafter reads (default: its family's).

  The folder is written beside `path` and swapped in whole (`files.atomic_dir`): a failed export
  leaves the previous drafter complete. Its other files (a tune_tree.json, say) are kept; the
  previous metadata.json is not when `metadata` is None (it described other weights). A folder
  inside the shipped assets needs `overwrite_shipped=True`; one holding another kind of model (a
  target, another family's drafter) is refused (`files.check_export_over`)."""
  assets.check_writable(path, overwrite_shipped, "the drafter folder")
  files.check_export_over(path, f"{method} drafter", "save_drafter")
  fam = family(method)
  tensors = {}
  for key, var in nnx.to_flat_state(params):
    x = jnp.asarray(var[...])
    tensors[".".join(str(k) for k in key)] = x.astype(dtype) if dtype else x
  tensors["d2t"] = jnp.asarray(d2t, jnp.int32)
  config = {
      "method": method,
      "net": config_utils.to_dict(net.with_dtype(dtype) if dtype else net, codecs=_NET_CODECS),
      "hidden_layers": list(fam.default_taps(target_cfg) if hidden_layers is None
                            else hidden_layers),
      "draft_vocab_size": int(np.asarray(d2t).size),
      "target": {"architecture": target_cfg.architecture, "vocab_size": target_cfg.vocab_size,
                 "hidden_size": target_cfg.hidden_size, "num_layers": target_cfg.num_layers,
                 "tokenizer_sha256": tokenizer_fingerprint(tokenizer)},
  }
  with files.atomic_dir(path, drop=(CONFIG, WEIGHTS, METADATA)) as out:
    files.save_safetensors(tensors, os.path.join(out, WEIGHTS), framework="flax")
    files.write_json(os.path.join(out, CONFIG), config, indent=2)
    if metadata is not None:
      files.write_json(os.path.join(out, METADATA), metadata, indent=2)


@pydantic.with_config(pydantic.ConfigDict(strict=True, allow_inf_nan=False))
class _TargetRecord(TypedDict, total=False):
  architecture: str
  vocab_size: Required[PosInt]
  hidden_size: Required[PosInt]
  num_layers: Required[PosInt]
  tokenizer_sha256: str | None


@pydantic.with_config(pydantic.ConfigDict(strict=True, allow_inf_nan=False))
class _FolderConfig(TypedDict, total=False):
  """A specjax drafter folder's config.json (module docstring), by type and range."""

  method: Required[str]
  net: Required[dict[str, Any]]
  hidden_layers: Required[list[NonNegInt]]
  draft_vocab_size: PosInt
  target: Required[_TargetRecord]
  tree: dict[str, Any]


_FOLDER_CONFIG = pydantic.TypeAdapter(_FolderConfig)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
  """A specjax drafter folder's config.json, each key checked for its type and range (an error
  names the file and the key)."""
  file = os.path.join(path, CONFIG)
  if not os.path.isfile(file):
    raise ValueError(f"no drafter at {path}: {CONFIG} is missing")
  try:
    with open(file, encoding="utf-8") as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"corrupt drafter config {file}: {e}") from None
  if not isinstance(config, dict):
    raise ValueError(f"drafter config {file} must hold a JSON object")
  for key in ("method", "net", "hidden_layers", "target"):
    if key not in config:
      raise ValueError(f"drafter config {file} has no {key!r}")
  try:
    _FOLDER_CONFIG.validate_python(config)
  except pydantic.ValidationError as e:
    err = e.errors(include_url=False)[0]
    raise ValueError(f"drafter config {file}: {config_utils.location(err['loc'])} "
                     f"{config_utils.requirement(err)}, got {err.get('input')!r}") from None
  return config


def check_target(config: dict[str, Any], target, path) -> None:
  """Raises ValueError when the drafter was made for a target of another shape or tokenizer."""
  want = config["target"]
  for key in ("vocab_size", "hidden_size", "num_layers"):
    have = getattr(target.config, key)
    if want.get(key) != have:
      raise ValueError(f"drafter {path} was trained for a target with {key} {want.get(key)}, "
                       f"this target has {have}")
  mine, theirs = want.get("tokenizer_sha256"), tokenizer_fingerprint(target.tokenizer)
  if mine and theirs and mine != theirs:
    raise ValueError(f"drafter {path} was trained for a target with another tokenizer: its "
                     "token ids would not mean the same thing")


def _read_tensors(path) -> dict[str, np.ndarray]:
  file = os.path.join(path, WEIGHTS)
  if not os.path.isfile(file):
    raise ValueError(f"drafter weights missing: {file}")
  try:
    with safe_open(file, framework="flax") as f:
      return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
  except (SafetensorError, OSError, ValueError) as e:
    raise ValueError(f"corrupt drafter weights {file}: {e}") from None


def load_drafter(path: str | os.PathLike, target, *, format: str | None = None,
                 method: str | None = None, **tree_options):
  """Loads a learned drafter for `target` (a `specjax.Target`); tree_options override the
  family's tree shape (Medusa/Hydra: `choices`; EAGLE/EAGLE-3: depth, top_k, total_tokens;
  DFlash: depth, top_k, total_tokens). On a target with a mesh the drafter is laid out on it
  (`specjax.sharding.place_drafter`).

  format: the folder's layout, "specjax" or a published one (`specjax.drafters.formats`: eagle3,
    eagle, medusa, dflash); default: detected from the folder.
  method: the family the caller asks for (a registered builder's name): a folder of another
    family is refused, naming both.
  draft_vocab (among the options, or a default the folder records): draft over only the first
    that many draft ids (`shrink_vocab`)."""
  read = read_drafter(path, target, format=format)
  if method is not None and read.method != method:
    raise ValueError(f"drafter folder {os.fspath(path)} holds a {read.method} drafter, not the "
                     f"{method} drafter asked for")
  options = {**read.tree, **{k: v for k, v in tree_options.items() if v is not None}}
  check_tree_options(read.method, options)
  read = shrink_vocab(read, options.pop("draft_vocab", None))
  drafter = family(read.method).assemble(read.net, read.params, jnp.asarray(read.d2t), target,
                                         read.hidden_layers, **options)
  return _placed(drafter, target)


def check_tree_options(method: str, options: dict[str, Any]) -> None:
  """ValueError naming any option a `method` drafter does not take, and listing those it does:
  its family's tree options (`Family.assemble`) and `draft_vocab`."""
  accepted = checks.keyword_options(family(method).assemble)
  if accepted is not None:
    checks.known_options(f"drafter {method!r}", options, [*accepted, "draft_vocab", "path",
                                                          "format"])


def read_drafter(path: str | os.PathLike, target, *, format: str | None = None):
  """A drafter folder's network for `target`, unassembled (`specjax.drafters.formats.Converted`:
  family, network config at the target's compute dtype, params, d2t, taps, default tree), every
  check of `load_drafter` done: what a tree is built from, and what fine-tuning starts from."""
  from specjax.target import Target
  if not isinstance(target, Target):
    raise ValueError(f"a drafter is read for a loaded target (specjax.load_target(folder)), got "
                     f"{type(target).__name__}")
  format = formats.detect(path) if format is None else format
  dtype = learned.drafter_dtype(target.config)
  if format != formats.SPECJAX:
    conv = formats.read(path, target, format)
    return dataclasses.replace(conv, net=conv.net.with_dtype(dtype))
  config = read_config(path)
  fam = family(config["method"])
  check_target(config, target, path)
  hidden_layers = tuple(config["hidden_layers"])
  for i in hidden_layers:
    if not 0 <= i <= target.config.num_layers:
      raise ValueError(f"drafter {path} reads hidden layer {i}, outside [0, "
                       f"{target.config.num_layers}]")
  net = config_utils.from_dict(fam.config_cls, config["net"], strict=False, codecs=_NET_CODECS,
                              where=f"drafter config {os.path.join(path, CONFIG)} (net)"
                              ).with_dtype(dtype)
  tensors = _read_tensors(path)
  if "d2t" not in tensors:
    raise ValueError(f"drafter weights {path} have no d2t (draft-to-target id map)")
  d2t = tensors.pop("d2t").astype(np.int32)
  if config.get("draft_vocab_size", d2t.size) != d2t.size:
    raise ValueError(f"drafter {path}: config.json says draft_vocab_size "
                     f"{config['draft_vocab_size']}, its d2t holds {d2t.size} ids")
  if d2t.ndim != 1 or d2t.min() < 0 or d2t.max() >= target.config.vocab_size:
    raise ValueError(f"drafter {path}: d2t ids outside the target vocabulary "
                     f"[0, {target.config.vocab_size})")
  params = params_from_tensors(fam, net, tensors, path)
  return formats.Converted(method=config["method"], net=net, params=params, d2t=d2t,
                           hidden_layers=hidden_layers, tree=dict(config.get("tree", {})),
                           source={"format": formats.SPECJAX, "path": os.fspath(path)})


def shrink_vocab(read, size: int | None):
  """A read drafter (`read_drafter`) that drafts over only its first `size` draft ids: its
  d2t's prefix, and the family's head over them (`Family.shrink_vocab`). The vocabulary is
  stored most frequent first (`learned.draft_vocab_from_counts`), so the prefix keeps the ids
  the drafter proposes most: every draft step's head reads fewer columns, while the round's
  recent tokens (`recent_tokens`) still reach the ids left out. None keeps the whole vocabulary.
  A vocabulary in id order (a published EAGLE-3's, say) has no such prefix: an error."""
  if size is None:
    return read
  vd = int(read.d2t.size)
  size = checks.integer("draft_vocab", size, lo=1, hi=vd)
  if size == vd:
    return read
  if np.all(np.diff(read.d2t) > 0):
    raise ValueError(f"draft_vocab={size}: this drafter's vocabulary of {vd} ids is in id "
                     "order, not most frequent first, so none of its prefixes is its most "
                     "frequent ids")
  net, params = family(read.method).shrink_vocab(read.net, read.params, size)
  return dataclasses.replace(read, net=net, params=params, d2t=read.d2t[:size])


def _placed(drafter, target):
  if target.mesh is not None:  # read once on the host, then each device gets its part
    drafter = sharding.place_drafter(drafter, target, target.mesh)
  return drafter


def export_drafter(path: str | os.PathLike, drafter, target, format: str,
                   dtype: str | None = None, *, overwrite_shipped: bool = False) -> None:
  """Writes a loaded learned drafter in a published layout (`specjax.drafters.formats`), for
  the tools that read that layout; `load_drafter` reads it back. A folder inside the shipped
  assets needs `overwrite_shipped=True`."""
  formats.write(path, drafter, target, format, dtype, overwrite_shipped=overwrite_shipped)


def set_default_tree(path: str | os.PathLike, *, overwrite_shipped: bool = False,
                     **tree_options) -> None:
  """Records tree options (e.g. tuned on held-out prompts) as the folder's defaults (its
  config.json, replaced atomically); a shipped folder needs `overwrite_shipped=True`."""
  assets.check_writable(path, overwrite_shipped, "the drafter folder")
  config = read_config(path)
  config["tree"] = tree_options
  files.write_json(os.path.join(path, CONFIG), config, indent=2)


def init_drafter(method: str, target, *, seed: int = 0, d2t=None, **tree_options):
  """An untrained drafter of `method` for `target`, its network at the module's own
  initialisation and the family's default taps and options (tests use it).

  d2t: the draft vocabulary as target ids (default: the whole target vocabulary)."""
  fam = family(method)
  check_tree_options(method, tree_options)
  d2t = jnp.arange(target.config.vocab_size, dtype=jnp.int32) if d2t is None else jnp.asarray(
      d2t, jnp.int32)
  taps = fam.default_taps(target.config)
  net = fam.make_config(target.config, draft_vocab_size=int(d2t.shape[0]),
                        num_features=len(taps)).with_dtype(
                            learned.drafter_dtype(target.config))
  params = learned.init_params(fam.module, net, seed)
  return fam.assemble(net, params, d2t, target, taps, **tree_options)


def params_from_tensors(fam: learned.Family, net, tensors: dict[str, np.ndarray], path
                        ) -> nnx.State:
  abstract = learned.abstract_params(fam.module, net)
  flat = []
  for key, var in nnx.to_flat_state(abstract):
    name = ".".join(str(k) for k in key)
    if name not in tensors:
      raise ValueError(f"drafter weights {path} lack {name}")
    value = tensors.pop(name)
    if tuple(value.shape) != tuple(var.shape):
      raise ValueError(f"drafter weight {name} has shape {value.shape}, the config implies "
                       f"{tuple(var.shape)}")
    flat.append((key, var.replace(jnp.asarray(value, dtype=var.dtype))))
  if tensors:
    raise ValueError(f"drafter weights {path} have unexpected tensors {sorted(tensors)[:5]}")
  return nnx.from_flat_state(flat)


def asset_dir(method: str) -> str:
  """Where the drafter shipped for the embedded target lives."""
  return os.path.join(assets.ASSETS_DIR, method)


def shipped_usable(method: str) -> Callable[[Any], bool]:
  """`usable(target)` for the registry: a shipped drafter exists and was made for this target."""

  def usable(target) -> bool:
    try:
      check_target(read_config(asset_dir(method)), target, asset_dir(method))
    except ValueError:
      return False
    return target.tokenizer is not None

  return usable
