"""Imports the real `pallas_kernels` package before the tests here do.

tests/conftest.py puts tests/ on sys.path, where this folder passes for a namespace package named
`pallas_kernels`. When the repo root is not on sys.path too (plain `pytest` with an editable
install), that namespace would shadow the real package. Importing it once with tests/ hidden
settles `sys.modules` for the session; `python -m pytest` from the repo root never needed this.
"""

import importlib
import pathlib
import sys

_TESTS = pathlib.Path(__file__).resolve().parents[1]


def _import_real_package():
  module = sys.modules.get("pallas_kernels")
  if module is not None and getattr(module, "__file__", None):
    return  # already the real package
  sys.modules.pop("pallas_kernels", None)
  saved = list(sys.path)
  sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _TESTS]
  try:
    importlib.import_module("pallas_kernels")
  finally:
    sys.path[:] = saved


_import_real_package()
