"""Shipped artefacts of the embedded default (HF-format folders), located beside this file."""

import os

ASSETS_DIR = os.path.dirname(os.path.abspath(__file__))
TARGET_DIR = os.path.join(ASSETS_DIR, "target")  # the Qwen3 code LM trained on the stdlib
DRAFT_LM_DIR = os.path.join(ASSETS_DIR, "draft_lm")  # the small draft LM with the same tokenizer

OVERWRITE_FLAG = "--overwrite-shipped"


class ShippedAssetError(ValueError):
  """A write into the shipped assets folder that was not asked for explicitly."""


def is_shipped(path: str | os.PathLike) -> bool:
  """Whether `path` (relative, or through symbolic links) lies in the shipped assets folder."""
  root = os.path.realpath(ASSETS_DIR)
  real = os.path.realpath(os.fspath(path))
  return real == root or real.startswith(root + os.sep)


def check_writable(path: str | os.PathLike, overwrite_shipped: bool, what: str) -> None:
  """Raises ShippedAssetError when `what` (e.g. "the drafter export") would write `path` inside
  the shipped assets folder and `overwrite_shipped` is false: the embedded target and drafters
  change only when named (`--overwrite-shipped`, `overwrite_shipped=True`)."""
  if overwrite_shipped or not is_shipped(path):
    return
  raise ShippedAssetError(
      f"{what} {os.fspath(path)} is inside the shipped assets folder "
      f"{os.path.realpath(ASSETS_DIR)}: replacing a shipped artefact must be asked for "
      f"explicitly, with {OVERWRITE_FLAG} on the command line (overwrite_shipped=True in the "
      "library)")


def check_not_shipped(path: str | os.PathLike, what: str) -> None:
  """Raises ShippedAssetError when `what` (a results folder, say) would write inside the shipped
  assets folder, which holds only the shipped artefacts: no flag lets it through."""
  if is_shipped(path):
    raise ShippedAssetError(
        f"{what} {os.fspath(path)} is inside the shipped assets folder "
        f"{os.path.realpath(ASSETS_DIR)}, which holds only the shipped target and drafters: "
        "write it elsewhere")
