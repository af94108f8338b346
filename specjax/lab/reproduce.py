"""The job behind `python -m experiments.reproduce <table>`: the paper-style results tables of
this library (`specjax.lab.tables`), each from one command, on the embedded default or any
target and drafters a config names (the benchmark's fields: `target`, `drafter.<method>`,
`datasets`, `prompts`, ...).

Every table measures through `specjax.lab.benchmark.run_methods` (warm-up, interleaved methods,
AR in the same run), so its figures mean what the benchmark's mean. Within one process the runs
are kept (`Session.measure`): `all` measures a configuration once when several tables show it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import numpy as np

from specjax import config_utils, decoding, distributed, files, provenance
from specjax.config_utils import NonEmpty, NonEmptyStr, PosInt, config
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import SCHEMA_VERSION
from specjax.lab.report import measured_with
from specjax.lab.session import Result, Session
from specjax.lab.tables import TABLES
from specjax.lab.tables.batch import BatchTable
from specjax.lab.tables.budget import BudgetTable
from specjax.lab.tables.depth import DepthTable
from specjax.lab.tables.methods import MethodsTable
from specjax.lab.tables.peers import PeersTable
from specjax.lab.tables.sampling import SamplingTable
from specjax.lab.tables.theory import TheoryTable


@config
class ReproduceConfig(BenchmarkConfig):
  """The benchmark's config, with the job's own defaults, plus each table's config (field
  `<table>_table`, e.g. --set theory_table.lengths=1,2,4). One-dataset tables (theory, budget,
  peers, batch) use the first dataset."""

  datasets: Annotated[tuple[NonEmptyStr, ...], NonEmpty] = (
      "humaneval", "stdlib_heldout", "stdlib_docstrings")
  num_prompts: PosInt = 4
  max_new_tokens: PosInt = 64
  profile_repeats: PosInt = 20  # loop lengths of the phase timings (theory), the oracle (budget)
  out: NonEmptyStr = "out/reproduce"
  methods_table: MethodsTable = MethodsTable()
  sampling_table: SamplingTable = SamplingTable()
  depth_table: DepthTable = DepthTable()
  theory_table: TheoryTable = TheoryTable()
  budget_table: BudgetTable = BudgetTable()
  peers_table: PeersTable = PeersTable()
  batch_table: BatchTable = BatchTable()

  def __post_init__(self):
    super().__post_init__()
    for name in TABLES:
      self.table(name).check(self)  # its methods against the run's drafters and labels

  def table(self, name: str) -> Any:
    """The config of table `name`."""
    return getattr(self, f"{name}_table")


def run(names: Sequence[str], cfg: ReproduceConfig, *, echo: Callable[[str], None] = print
        ) -> dict[str, dict[str, Any]]:
  """Runs the named tables in order under one progress bar, writes `<out>/<table>.md`, `.json`
  and `.png` for each, echoes each table with its wall time, and returns {table: {"result",
  "seconds", "files"}}."""
  from tqdm.auto import tqdm
  unknown = [n for n in names if n not in TABLES]
  if unknown:
    raise ValueError(f"unknown table(s) {unknown}; tables: {list(TABLES)} or all")
  if distributed.is_main_process():  # before measuring
    files.check_output_dir(cfg.out, "tables' folder (out)")
  block = provenance.collect(cfg)
  done: dict[str, dict[str, Any]] = {}
  with tqdm(total=0, desc="reproduce", dynamic_ncols=True) as bar:
    session = Session(cfg, bar)
    ends = np.cumsum([TABLES[n].units(session, cfg.table(n)) for n in names])
    bar.total = int(ends[-1]) if len(ends) else 0
    bar.refresh()
    for name, end in zip(names, ends):
      bar.set_postfix(table=name)
      start = time.perf_counter()
      result = TABLES[name].build(session, cfg.table(name), cfg.out)
      seconds = time.perf_counter() - start
      decoding.release_compiled()  # later tables keep the runs, not the programs
      bar.update(max(int(end) - bar.n, 0))  # runs kept from an earlier table took no time
      # A multi-process run measures on every process and writes from process 0.
      written = write(name, result, cfg, block, seconds) if distributed.is_main_process() else []
      done[name] = {"result": result, "seconds": seconds, "files": written + result.figures}
      bar.clear()
      echo(f"\n{result.markdown}\n{name}: {seconds:.0f} s, wrote " + ", ".join(done[name]["files"]))
      bar.refresh()
  if len(names) > 1:
    echo("time per table: " + ", ".join(f"{n} {d['seconds']:.0f} s" for n, d in done.items()))
  return done


def write(name: str, result: Result, cfg: ReproduceConfig, block: dict[str, Any],
          seconds: float) -> list[str]:
  """`<out>/<name>.md` and `.json`, replaced together (`files.atomic_group`): a failed write
  leaves the previous pair whole."""
  md, js = os.path.join(cfg.out, f"{name}.md"), os.path.join(cfg.out, f"{name}.json")
  with files.atomic_group() as group:
    group.write_text(md, f"{measured_with(provenance.header(block))}\n\n{result.markdown}\n"
                     f"Table time: {seconds:.0f} s.\n")
    group.write_json(js, {"table": name, "schema_version": SCHEMA_VERSION,
                          "config": config_utils.to_dict(cfg),
                          "provenance": block, "seconds": seconds, **result.payload},
                     indent=1, allow_nan=False)
  return [md, js]
