"""Where a figure came from: package versions, device, commit, date and command of a run.

One block, written by the benchmark (results.json / results.md), the trainers' metadata.json and
tune_tree, so a figure can be traced to the code and machine that produced it. Nothing here may
fail a run: what cannot be found (no git, no checkout) is recorded as None.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any

PACKAGES = ("specjax", "jax", "jaxlib", "flax", "optax", "numpy")


def _version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def _git(*args: str) -> str | None:
  """`git args` in the checkout holding this package, or None (no git, not a checkout)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def _portable(arg: str) -> str:
  """Paths under the working directory become relative, so a record names no home directory."""
  if not os.path.isabs(arg):
    return arg
  rel = os.path.relpath(arg)
  return arg if rel.startswith("..") else rel


def collect(config: Any = None) -> dict[str, Any]:
  """The provenance block; `config` (a dataclass or dict) is recorded as JSON."""
  import jax

  from specjax import config_utils
  commit = _git("rev-parse", "HEAD")
  status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
  devices = jax.devices()
  return {
      "versions": {name: _version(name) for name in PACKAGES},
      "python": platform.python_version(),
      "backend": jax.default_backend(),
      "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices],
      "platform": platform.platform(),
      "cpu_count": os.cpu_count(),
      "git_commit": commit,
      "git_dirty": None if status is None else bool(status),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
      "command": [_portable(a) for a in sys.argv],
      "config": None if config is None else config_utils.to_dict(config, strings=_portable),
  }


def header(block: dict[str, Any]) -> str:
  """One line naming what a table's figures were measured with."""
  v = block["versions"]
  commit = (block["git_commit"] or "unknown")[:12] + ("+dirty" if block["git_dirty"] else "")
  return (f"specjax {v['specjax']} (commit {commit}), jax {v['jax']}, "
          f"{block['backend']} {len(block['devices'])} device(s) "
          f"[{block['devices'][0] if block['devices'] else '-'}], {block['cpu_count']} CPUs, "
          f"{block['date_utc']}: {' '.join(block['command'])}")
