"""The lab sits above the core: no module of `specjax` outside `specjax.lab` imports it (module
or function level, read off the source with `ast`), so what runs never depends on what
measures it. Only the lab itself, the experiments, the configs and the tests may."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imported(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def test_the_core_imports_nothing_of_the_lab():
  core = [p for p in (ROOT / "specjax").rglob("*.py") if "lab" not in p.relative_to(ROOT).parts]
  assert core
  lab = {str(p.relative_to(ROOT)): sorted(n for n in _imported(p) if n.split(".")[:2] == [
      "specjax", "lab"]) for p in core}
  assert not {p: names for p, names in lab.items() if names}
