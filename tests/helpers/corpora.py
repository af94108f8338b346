"""Tiny source corpora for trainer tests: stdlib files copied into a temporary folder."""

from __future__ import annotations

import glob
import os
import shutil
import sysconfig

from specjax.data.stdlib_code import split_of


def stdlib_source_dir(out, packages: tuple[str, ...]) -> str:
  """The .py files of stdlib `packages` in `out`, plus copies named so that at least two hash
  into the held-out split (both splits must be non-empty)."""
  stdlib = sysconfig.get_paths()["stdlib"]
  files = [f for pkg in packages for f in sorted(glob.glob(os.path.join(stdlib, pkg, "*.py")))]
  for f in files:
    shutil.copy(f, os.path.join(out, f"{os.path.basename(os.path.dirname(f))}_"
                                     f"{os.path.basename(f)}"))
  i = held = 0
  while held < 2:
    name = f"extra_{i}.py"
    if split_of(name) == "heldout":
      shutil.copy(files[i % len(files)], os.path.join(out, name))
      held += 1
    i += 1
  return os.fspath(out)
