"""The package layout's rules, read off the source with `ast` (no import is executed):

  * every import counts: module-level and function-level statements, relative ones, and
    `importlib.import_module` / `__import__` of a constant name, which are followed like a
    statement; an import of a computed name (or of a file) is refused, but for the entry point
    that imports the config a user names (`ALLOWED_COMPUTED`);
  * the project's import graph has no cycle;
  * every module lies in one of `LAYERS` and imports only modules of its own layer or lower ones
    (but for `ALLOWED_UP`: the entry point that finds the configs folder);
  * nothing but the lab itself, the experiments and their configs imports the lab (`LAB`);
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

# The layers, lowest first: a module imports modules of its own layer or of lower ones only. An
# entry is a module's name, or `pkg.*` for a package and every module under it; a module lies in
# the layer that names it, else in that of the longest `pkg.*` entry covering it.
LAYERS = (
    ("kernels", ["pallas_kernels.*"]),
    ("leaf utilities", ["specjax.assets", "specjax.checks", "specjax.compile_cache",
                        "specjax.config_utils", "specjax.files", "specjax.metrics",
                        "specjax.provenance", "specjax.timing", "specjax.interop.safetensors_file",
                        "specjax.interop.tokenizer"]),
    ("meshes", ["specjax.sharding", "specjax.distributed"]),
    ("the model", ["specjax.models.*"]),
    ("trees, sampling and acceptance",
     ["specjax.sampling", "specjax.children", "specjax.trees", "specjax.verify"]),
    ("a loaded target and its HF folders", ["specjax.target", "specjax.interop.*"]),
    # What every drafter shares, and the loaders that serve any registered family or layout:
    # none of them imports a family (the families import `io` to register).
    ("the drafter protocol and generic drafter code",
     ["specjax.drafters.base", "specjax.drafters.registry", "specjax.drafters.learned",
      "specjax.drafters.static_tree", "specjax.drafters.eagle_common",
      "specjax.drafters.format_common", "specjax.drafters.formats", "specjax.drafters.io"]),
    ("drafter families and their published layouts", ["specjax.drafters.*"]),
    ("the drafters facade", ["specjax.drafters"]),
    ("decoding (the jitted program, its host side) and the package facade",
     ["specjax.rounds", "specjax.decoding", "specjax"]),
    ("data and training", ["specjax.data.*", "specjax.train.*"]),
    ("entry-point plumbing", ["specjax.cli"]),
    ("the lab", ["specjax.lab.*"]),
    ("configs", ["configs.*"]),
    ("experiments", ["experiments.*"]),
)
# The measuring code. The library imports none of it.
LAB = ("specjax.lab",)
LAB_USERS = ("specjax.lab", "experiments", "configs")  # configs name the lab's config classes

# Imports of a computed name allowed, by (module, function): the name is a user's input, not a
# dependency of the package. `load_config` imports the config a command line names
# (`configs.<name>`, a dotted module or a file), a module above every caller of it.
ALLOWED_COMPUTED = {("specjax.config_utils", "load_config")}

# Imports of a higher layer allowed, by (module, imported): `cli.resolve_config_path` imports the
# (empty) `configs` package only for its folder, to find `--config configs/x.py` from anywhere.
ALLOWED_UP = {("specjax.cli", "configs")}

_IMPORTERS = ("import_module", "__import__", "spec_from_file_location")


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


class _Scan(ast.NodeVisitor):
  """The project modules that one module's source imports (`edges`), and its imports of a
  computed name (`computed`: (enclosing function, call))."""

  def __init__(self, module: str):
    self.module, self.edges, self.computed, self._where = module, set(), [], []

  def _inside(self, node):
    self._where.append(node.name)
    self.generic_visit(node)
    self._where.pop()

  visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _inside

  def visit_Import(self, node):
    self.edges.update(_resolve(a.name) for a in node.names)

  def visit_ImportFrom(self, node):
    base = node.module or ""
    if node.level:  # relative to this module's package (a package's __init__ is its own)
      package = self.module if MODULES[self.module].name == "__init__.py" else (
          self.module.rpartition(".")[0])
      parts = package.split(".")[:len(package.split(".")) - node.level + 1]
      base = ".".join(parts + ([node.module] if node.module else []))
    for a in node.names:
      # `from pkg import sub` imports the submodule sub, not the package's facade.
      sub = f"{base}.{a.name}"
      self.edges.add(_resolve(sub) if sub in MODULES else _resolve(base))

  def visit_Call(self, node):
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in _IMPORTERS:
      arg = node.args[0] if node.args else None
      if (name != "spec_from_file_location" and isinstance(arg, ast.Constant)
          and isinstance(arg.value, str) and not arg.value.startswith(".")):
        self.edges.add(_resolve(arg.value))
      else:
        self.computed.append((".".join(self._where) or "<module>", ast.unparse(node)))
    self.generic_visit(node)


def _scan(module: str, source: str) -> _Scan:
  scan = _Scan(module)
  scan.visit(ast.parse(source))
  scan.edges -= {None, module}
  return scan


SCANS = {name: _scan(name, path.read_text()) for name, path in MODULES.items()}
GRAPH = {name: scan.edges for name, scan in SCANS.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph` (its modules in order, the first repeated last), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(node, path):
    state[node] = 1
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt, path + [nxt])):
        return found
    state[node] = 2
    return None

  for name in sorted(graph):
    if name not in state and (found := visit(name, [name])):
      return found
  return None


def _layer(module: str) -> int | None:
  """The index in LAYERS of the layer `module` lies in, or None."""
  covering = []
  for rank, (_, entries) in enumerate(LAYERS):
    if module in entries:
      return rank
    covering += [(len(e), rank) for e in entries
                 if e.endswith(".*") and (module == e[:-2] or module.startswith(e[:-1]))]
  return max(covering)[1] if covering else None


def test_imports_of_a_computed_name_are_refused():
  refused = {m: [c for c in scan.computed if (m, c[0]) not in ALLOWED_COMPUTED]
             for m, scan in SCANS.items()}
  assert not any(refused.values()), {m: c for m, c in refused.items() if c}


def test_dynamic_imports_are_followed_and_a_hidden_cycle_is_found():
  """The check itself: importlib's calls are edges or refusals, and a cycle through one (as
  `io -> formats -> family -> io` once was, behind `importlib.import_module(f"...{name}")`)
  fails the graph."""
  scan = _scan("specjax.drafters.formats", "import importlib\n"
               "def load(name):\n"
               "  importlib.import_module('specjax.drafters.eagle_format')\n"
               "  __import__('specjax.sharding')\n"
               "  importlib.import_module(f'specjax.drafters.{name}_format')\n")
  assert scan.edges == {"specjax.drafters.eagle_format", "specjax.sharding"}
  assert [where for where, _ in scan.computed] == ["load"]
  hidden = {**GRAPH, "specjax.drafters.formats": GRAPH["specjax.drafters.formats"] | scan.edges}
  assert "specjax.drafters.formats" in (_cycle(hidden) or [])


def test_the_import_graph_has_no_cycle():
  found = _cycle(GRAPH)
  assert found is None, "import cycle: " + " -> ".join(found)


def test_every_module_lies_in_a_layer():
  assert not [m for m in MODULES if _layer(m) is None]


def test_no_module_imports_a_higher_layer():
  up = [f"{m} ({LAYERS[_layer(m)][0]}) imports {i} ({LAYERS[_layer(i)][0]})"
        for m in sorted(GRAPH) for i in sorted(GRAPH[m])
        if _layer(i) > _layer(m) and (m, i) not in ALLOWED_UP]
  assert not up, "\n".join(up)


def _within(module: str, packages) -> bool:
  return any(module == p or module.startswith(p + ".") for p in packages)


def test_only_the_lab_experiments_and_configs_import_the_lab():
  """Passes vacuously for `specjax.lab` until that package exists."""
  users = {m: sorted(i for i in GRAPH[m] if _within(i, LAB)) for m in GRAPH
           if not _within(m, LAB + LAB_USERS)}
  assert not any(users.values()), {m: i for m, i in users.items() if i}


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
