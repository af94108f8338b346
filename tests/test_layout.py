"""The package layout's rules, read off the source with `ast` (no import is executed):

  * the project's import graph (module-level and function-level imports) has no cycle;
  * no module of `specjax.drafters` imports the package facade `specjax.drafters` itself (family
    files import the registry; the facade imports them);
  * `pallas_kernels` imports nothing of the project: kernels are a leaf;
  * the generic drafter code (trainer, tree tuner, comparison, shared recipe) names no learned
    family: everything family-specific lives on the family object in its own file.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("specjax", "pallas_kernels", "experiments", "configs")


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for package in PACKAGES:
    for path in (ROOT / package).rglob("*.py"):
      name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
      mods[name.removesuffix(".__init__")] = path
  return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
  """The project module an import names (its longest known prefix), or None."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(path: pathlib.Path) -> set[str]:
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(_resolve(a.name) for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      # `from pkg import sub` imports the submodule sub, not the package's facade.
      out.update(_resolve(f"{node.module}.{a.name}") if f"{node.module}.{a.name}" in MODULES
                 else _resolve(node.module) for a in node.names)
  return out - {None}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def test_the_import_graph_has_no_cycle():
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(node, path):
    state[node] = 1
    for nxt in sorted(GRAPH[node]):
      if state.get(nxt) == 1:
        pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
      if nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = 2

  for name in sorted(GRAPH):
    if name not in state:
      visit(name, [name])


def test_no_drafter_module_imports_the_package_facade():
  back = [m for m in GRAPH if m.startswith("specjax.drafters.") and "specjax.drafters" in GRAPH[m]]
  assert not back


def test_pallas_kernels_is_a_leaf():
  outside = {m: sorted(i for i in GRAPH[m] if not i.startswith("pallas_kernels"))
             for m in GRAPH if m.startswith("pallas_kernels")}
  assert not any(outside.values()), outside


@pytest.mark.parametrize("module", ["specjax.train.drafter", "specjax.drafters.io",
                                    "experiments.tune_tree", "experiments.compare_drafters",
                                    "experiments.train_drafter", "configs.drafter_common"])
def test_generic_code_names_no_family(module):
  from specjax.drafters import registry
  families = set(registry.families())
  tree = ast.parse(MODULES[module].read_text())
  named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in families}
  assert not named, f"{module} names {sorted(named)}"


def test_generic_trainer_names_no_family_option():
  """The trainer reads a family's options only through `learned.FamilyOptions`' properties and
  the family's own hooks: no name in its code (variable, attribute, keyword or word of a string)
  is an option of a registered family, so a new option is a field in its family's file."""
  import re

  from specjax.drafters import learned, registry
  options = {name for m in registry.families()
             for name in learned.option_names(registry.family(m).options_cls)}
  words = set()
  for n in ast.walk(ast.parse(MODULES["specjax.train.drafter"].read_text())):
    if isinstance(n, ast.Name):
      words.add(n.id)
    elif isinstance(n, ast.Attribute):
      words.add(n.attr)
    elif isinstance(n, ast.keyword) and n.arg:
      words.add(n.arg)
    elif isinstance(n, ast.Constant) and isinstance(n.value, str):
      words.update(re.findall(r"\w+", n.value))
  assert len(options) >= 10 and not words & options, sorted(words & options)
