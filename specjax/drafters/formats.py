"""Published drafter checkpoints, read into specjax's families and written back.

`specjax.drafters.load_drafter(path, target)` detects the layout of a folder; `format=` forces
one. Each format maps a published layout onto an existing family, without retraining:

  specjax   specjax's own folders (`specjax.drafters.io`)
  eagle3    EAGLE-3 heads (the authors' and SpecForge's layout)       -> eagle3
  eagle     EAGLE-1/2 heads (`fc` [H, 2H], embedding saved)             -> eagle
  medusa    Medusa-1 heads (`medusa_lm_head.*`)                        -> medusa
  dflash    DFlash drafters (`dflash_config`, `layers.*`)              -> dflash

Layer-index conventions differ between publishers; every format states how it turns the
folder's ids into specjax's hidden-state indices (0 = the embeddings, i = the output of layer
i, L = the final normed state) and records it in the drafter's `source`.

This module is the registry of layouts. Each layout is a file beside its family
(`eagle3_format.py`, ...) that registers a `Format` here; the package facade `specjax.drafters`
imports those files as it imports the families. Neither this module nor `specjax.drafters.io`
reads a family's file: the families import `io` (`io.register_family`), and the layouts import
the families.
"""

from __future__ import annotations

import abc
import os
import warnings
from typing import Any

from specjax import assets, files
from specjax.drafters import registry
from specjax.drafters.format_common import Checkpoint, Converted, read_config, tensor_names

SPECJAX = "specjax"


class Format(abc.ABC):
  """One published layout. Subclasses set `name`, `method` (the family it maps onto) and
  `weight_names` (file names of its own besides model.safetensors and pytorch_model.bin)."""

  name: str
  method: str
  weight_names: tuple[str, ...] = ()
  # Whether `write` also needs the target itself (e.g. a layout that saves its embedding): then
  # it is called with `target=`.

  @abc.abstractmethod
  def matches(self, config: dict[str, Any] | None, tensors: frozenset[str]) -> bool:
    """Whether a folder with this config.json (None: absent) and these tensor names is in this
    layout."""

  @abc.abstractmethod
  def read(self, ckpt: Checkpoint, target) -> Converted:
    """The folder as a specjax family's network for `target` (a `specjax.Target`): every
    tensor used, shapes checked."""

  @abc.abstractmethod
  def write(self, path: str, drafter, target, dtype: str | None = None) -> None:
    """Writes a drafter of `self.method` in this layout."""


_FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
  _FORMATS[fmt.name] = fmt
  return fmt


def names() -> list[str]:
  return [SPECJAX, *_FORMATS]


def get(name: str) -> Format:
  """The published layout `name` (`specjax`, the library's own, has no Format: its folders are
  written by `drafters.io.save_drafter` and read by `load_drafter`)."""
  if name == SPECJAX:
    raise ValueError(f"{SPECJAX!r} is specjax's own drafter folder layout, which "
                     "specjax.drafters.io.save_drafter writes and load_drafter reads; the "
                     f"published formats are {sorted(_FORMATS)}")
  if name not in _FORMATS:
    raise ValueError(f"unknown drafter format {name!r}; known: {names()}")
  return _FORMATS[name]


def detect(path: str | os.PathLike) -> str:
  """The layout of the drafter folder at `path`: "specjax" or a published format's name."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise ValueError(f"no drafter folder at {path}")
  config = read_config(path)
  if config is not None and ("method" in config or "net" in config):
    return SPECJAX  # specjax's own keys (`drafters.io.read_config` names any missing one)
  tensors = tensor_names(path, [n for f in _FORMATS.values() for n in f.weight_names])
  if config is None and not tensors:
    raise ValueError(f"no drafter at {path}: config.json is missing, and no weights of a "
                     f"published layout either (files {sorted(os.listdir(path))[:8]})")
  found = [f.name for f in _FORMATS.values() if f.matches(config, tensors)]
  if len(found) == 1:
    return found[0]
  if found:
    raise ValueError(f"{path} matches several drafter formats {found}: pass format=")
  what = "no config.json" if config is None else f"config.json keys {sorted(config)[:12]}"
  raise ValueError(f"{path} is not a drafter folder of a known format ({names()}): {what}, "
                   f"tensors {sorted(tensors)[:6]}, files {sorted(os.listdir(path))[:8]}")


# config.json keys by which published drafters record the target they were trained for.
TARGET_KEYS = ("base_model_name_or_path", "base_model", "target_model", "target_model_path")


def read(path: str | os.PathLike, target, format: str) -> Converted:
  """Reads a published folder in layout `format` for `target`; warns when the folder records
  another target than the folder `target` was loaded from (`check_recorded_target`)."""
  fmt = get(format)
  ckpt = Checkpoint(path, fmt.weight_names)
  converted = fmt.read(ckpt, target)
  check_recorded_target(ckpt.config, target, os.fspath(path))
  return converted


def _model_name(path: str) -> str:
  return os.path.basename(os.path.normpath(path)).lower()


def check_recorded_target(config: dict[str, Any] | None, target, where: str) -> None:
  """A drafter whose shapes fit the target but whose config.json names another model (Medusa's
  `base_model_name_or_path`, ...) was trained on another model's states: it loads, and stays
  lossless, but drafts worse. Warns when the recorded name and the target's folder
  (`Target.source`) differ by their last path component (hub ids and folders are named alike)."""
  recorded = next((config[k] for k in TARGET_KEYS
                   if config and isinstance(config.get(k), str) and config[k]), None)
  source = getattr(target, "source", None)
  if recorded is None or source is None or _model_name(recorded) == _model_name(source):
    return
  warnings.warn(f"{where}: this drafter records its target as {recorded!r}, but the target was "
                f"loaded from {source}: its shapes fit, so it loads and the output stays "
                "lossless, but a drafter trained on another model's states is accepted less "
                "often", UserWarning, stacklevel=3)


def write(path: str | os.PathLike, drafter, target, format: str, dtype: str | None = None,
          *, overwrite_shipped: bool = False) -> None:
  """Writes `drafter` (a learned drafter of the format's family, for `target`) in layout
  `format`; `dtype` casts the stored weights. The folder is written beside `path` and swapped in
  whole (`specjax.files.atomic_dir`), so a failed write leaves the previous folder complete;
  its files the layout does not write are kept, but for earlier weights (safetensors files and
  their index). A folder inside the shipped assets needs `overwrite_shipped=True`."""
  assets.check_writable(path, overwrite_shipped, f"the {format} drafter folder")
  fmt = get(format)
  if not isinstance(drafter.net, registry.family(fmt.method).config_cls):
    raise ValueError(f"the {format} layout holds {fmt.method} drafters, got one with a "
                     f"{type(drafter.net).__name__} network")
  stale = ("*.safetensors", "*.safetensors.index.json")
  with files.atomic_dir(path, drop=stale) as out:
    fmt.write(out, drafter, target, dtype)

