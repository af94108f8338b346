"""The Colab TPU notebook: its .ipynb is its reviewed .py source, and it runs end to end.

`experiments/colab_tpu.py` (jupytext percent format) is the source; `experiments/colab_tpu.ipynb`
is generated from it (`jupytext --to ipynb experiments/colab_tpu.py`). The end-to-end test runs
the .ipynb in a fresh ipykernel of this interpreter with 8 emulated CPU devices and small
parameters injected after the `parameters` cell (as papermill does), so the mesh cell builds a
real 8-device mesh; nothing is installed or downloaded.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "experiments" / "colab_tpu.py"
NOTEBOOK = ROOT / "experiments" / "colab_tpu.ipynb"


def _cells(nb) -> list[tuple[str, str, list[str]]]:
  return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def test_notebook_is_generated_from_its_source():
  """Same cells (type, source, tags) in the .py and the .ipynb, one `parameters` cell, and the
  committed .ipynb carries no outputs."""
  source = jupytext.read(SOURCE)
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  assert _cells(notebook) == _cells(source), (
      "experiments/colab_tpu.ipynb is out of date: run "
      "`jupytext --to ipynb experiments/colab_tpu.py`")
  tagged = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1 and tagged[0].cell_type == "code"
  assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")
  nbformat.validate(notebook)


def _kernel_manager(tmp_path: pathlib.Path, env: dict[str, str]):
  """A kernel of this interpreter (not whichever `python3` kernelspec is installed)."""
  from jupyter_client import KernelManager
  from jupyter_client.kernelspec import KernelSpecManager

  spec_dir = tmp_path / "kernels" / "specjax-test"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "specjax test", "language": "python", "env": env}))
  specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
  return KernelManager(kernel_name="specjax-test", kernel_spec_manager=specs)


def _text(nb) -> str:
  out = []
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      out.append(o.get("text", "") + o.get("data", {}).get("text/markdown", "")
                 + o.get("data", {}).get("text/plain", ""))
  return "\n".join(out)


def execute(tmp_path: pathlib.Path):
  """The notebook executed with the test's parameters in `tmp_path` (its working directory)."""
  import nbclient

  from tests.helpers.corpora import stdlib_source_dir

  source_dir = tmp_path / "src"
  source_dir.mkdir()
  params = {
      "INSTALL": False, "NUM_PROMPTS": 2, "MAX_PROMPT_TOKENS": 64, "MAX_NEW_TOKENS": 16,
      "METHODS": ("prompt_lookup",), "TRAIN_METHOD": "medusa", "TRAIN_STEPS": 4,
      "TRAIN_ROWS": 8, "TRAIN_SOURCE_DIR": stdlib_source_dir(source_dir, ("json",)),
      "TRAIN_OVERRIDES": ("source=corpus", "seq_len=32", "batch_size=2", "eval_rows=4",
                          "draft_vocab_size=512"),
      "DATA_DIR": os.fspath(tmp_path / "tfds"), "WORKDIR": os.fspath(tmp_path / "runs"),
  }
  nb = nbformat.read(NOTEBOOK, as_version=4)
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
  injected.metadata["tags"] = ["injected-parameters"]
  nb.cells.insert(at + 1, injected)

  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  pythonpath = [os.fspath(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                    if p]
  env = {"XLA_FLAGS": " ".join(flags + ["--xla_force_host_platform_device_count=8"]),
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(pythonpath),
         "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
  client = nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path, env), timeout=600,
                                   resources={"metadata": {"path": os.fspath(tmp_path)}})
  client.execute()
  return nb


@pytest.mark.slow
def test_notebook_runs_end_to_end_on_8_cpu_devices(tmp_path):
  """Executes every cell with INSTALL off and tiny sizes: devices, the 8-device mesh, AR and
  prompt lookup on 2 HumanEval prompts, a 4-step Medusa training run on a few stdlib files and
  decoding with its export (the load path of a learned drafter; the notebook's default METHODS
  add shipped ones, each another compile), and the notebook's own drafter, all identical to
  autoregressive decoding."""
  pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  nb = execute(tmp_path)
  text = _text(nb)
  assert "8 cpu devices" in text and "dp=8,tp=1 over 8 cpu devices" in text
  assert "not available: []" in text
  assert "bigram output identical to autoregressive decoding" in text
  assert "training on" in text and "4 steps" in text
  assert "| NO |" not in text
  images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert len(images) >= 3  # acceptance by depth twice, the training loss
  assert os.path.isfile(tmp_path / "runs" / "medusa" / "export" / "config.json")
