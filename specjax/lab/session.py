"""What the tables of one reproduce job share: the target, the prompts and the runs measured so
far (`Session`), what a table hands back (`Result`) and what a table is (`Table`).

A table asks the session for runs (`Session.measure`); a run another table made already is
handed back instead of measured again, so `all` measures a configuration once when several
tables show it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from specjax import drafters
from specjax.drafters import registry
from specjax.lab.benchmark import (
  common_pad,
  configured_target,
  load_prompts,
  methods_of,
  run_methods,
)
from specjax.lab.benchmark_config import BenchmarkConfig, dataset_name, datasets_of
from specjax.lab.records import AR, MethodRecord, add_speedups
from specjax.sampling import SamplingConfig


def is_learned(method: str, cfg: BenchmarkConfig) -> bool:
  """A learned family, or a row label naming a drafter folder (`drafter.<label>=DIR`)."""
  return method in registry.families() or (method in cfg.drafter
                                           and method not in drafters.names())


def family_of(method: str, cfg: BenchmarkConfig) -> str:
  """The registered family behind a row: itself, or for a label the folder's family."""
  if method in drafters.names() or method not in cfg.drafter:
    return method
  from specjax.drafters import formats, io
  path = cfg.drafter[method]
  layout = formats.detect(path)  # a published layout is named after its family
  return io.read_config(path)["method"] if layout == formats.SPECJAX else layout


def check_methods(field: str, methods: Iterable[str], allowed: Iterable[str],
                  cfg: BenchmarkConfig) -> None:
  """Every method a table's `field` names is one it can run: one of `allowed` or the label of a
  drafter folder (`drafter.<label>=DIR`), said before anything runs."""
  allowed = sorted(allowed)
  labels = set(cfg.drafter) - set(drafters.names())  # folders named by a label
  for method in methods:
    if method not in allowed and method not in labels:
      raise ValueError(f"{field} holds {method!r}, which it cannot run: it takes {allowed} or "
                       "a folder's label (drafter.<label>=DIR)")


def prompt_counts(records: Sequence[MethodRecord]) -> str:
  """The prompts the records' runs decoded: "4 prompts", or per dataset where they differ (a
  dataset with fewer prompts than the config asks for runs them all)."""
  counts = {r.dataset: r.prompts for r in records}
  if len(set(counts.values())) == 1:
    return f"{next(iter(counts.values()))} prompts"
  return "prompts " + ", ".join(f"{d}: {n}" for d, n in counts.items())


class Session:
  """The target, prompts and measurements of one job. `measure` keeps each run's records, so a
  table asking for a run another table made reuses it."""

  def __init__(self, cfg: BenchmarkConfig, bar=None):
    self.cfg = cfg
    self.bar = bar
    self.target = configured_target(cfg)
    self.datasets = [dataset_name(d) for d in datasets_of(cfg)]
    self._sources = dict(zip(self.datasets, datasets_of(cfg)))
    self._prompts: dict[tuple[str, int], list[list[int]]] = {}
    self._runs: dict[tuple, tuple[MethodRecord, int, int, bool]] = {}
    self._groups = 0

  @property
  def first_dataset(self) -> str:
    return self.datasets[0]

  def methods(self) -> list[str]:
    return methods_of(self.cfg, self.target)

  def learned(self, methods: Sequence[str] = ()) -> list[str]:
    """The drafters a table of learned drafters shows: its `methods`, or when it names none
    every learned drafter of the run."""
    return list(methods) or [m for m in self.methods() if is_learned(m, self.cfg)]

  def prompts(self, dataset: str, n: int | None = None) -> list[list[int]]:
    n = self.cfg.num_prompts if n is None else n
    if (dataset, n) not in self._prompts:
      cfg = dataclasses.replace(self.cfg, num_prompts=n)
      self._prompts[dataset, n] = load_prompts(self.target, self._sources[dataset], cfg)
    return self._prompts[dataset, n]

  @property
  def greedy(self) -> SamplingConfig:
    """The job's sampling at temperature 0: what every table but `methods` decodes with."""
    return dataclasses.replace(self.cfg.sampling, temperature=0.0)

  def sampling_at(self, temperature: float, top_p: float | None = None) -> SamplingConfig:
    """The job's sampling (its top-k, and its top-p unless `top_p`) at `temperature`."""
    top_p = self.cfg.top_p if top_p is None else float(top_p)
    return dataclasses.replace(self.cfg.sampling, temperature=float(temperature), top_p=top_p)

  @functools.cached_property
  def pad_to(self) -> int:
    """One padded prompt length for every table (`common_pad` over the datasets' prompts): each
    method runs one compiled program in the whole job."""
    return common_pad(self.target, [self.prompts(d) for d in self.datasets])

  def measure(self, dataset: str, runs: Sequence[tuple[str, dict[str, Any] | None]], *,
              sampling: SamplingConfig | None = None, repeats: int = 1, profile: bool = False,
              batch_size: int = 1, num_prompts: int | None = None, rule: str | None = None
              ) -> list[MethodRecord]:
    """`run_methods` records of `runs` on `dataset`, with speedups when AR is among them, under
    `sampling` (None: `greedy`) and acceptance `rule` (None: the job's). Kept runs are reused
    when every one is there, timed as often and profiled if asked, and (for speedups) from one
    run. The records are copies."""
    sampling = self.greedy if sampling is None else sampling
    rule = self.cfg.rule if rule is None else rule
    n = len(self.prompts(dataset, num_prompts))
    keys = [(dataset, sampling, rule, batch_size, n, m, json.dumps(o, sort_keys=True))
            for m, o in runs]
    kept = [self._runs.get(k) for k in keys]
    usable = all(k is not None and k[2] >= repeats and (k[3] or not profile) for k in kept)
    if usable and (len({k[1] for k in kept}) == 1 or all(m != AR for m, _ in runs)):
      return [copy.copy(k[0]) for k in kept]
    cfg = dataclasses.replace(self.cfg, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, rule=rule)
    records = [dataclasses.replace(r, dataset=dataset, temperature=sampling.temperature,
                                   top_p=sampling.top_p, options=o)
               for r, (_, o) in zip(run_methods(
                   self.target, runs, self.prompts(dataset, num_prompts), cfg, self.bar,
                   repeats=repeats, profile=profile, batch_size=batch_size, pad_to=self.pad_to),
               runs)]
    if any(m == AR for m, _ in runs):
      add_speedups(records)
    self._groups += 1
    for k, r in zip(keys, records):
      self._runs[k] = (r, self._groups, repeats, profile)
    return [copy.copy(r) for r in records]


@dataclasses.dataclass(frozen=True)
class Result:
  """What a table writes: its Markdown (without the provenance line), JSON payload, figures."""

  markdown: str
  payload: dict[str, Any]
  figures: list[str]


@dataclasses.dataclass(frozen=True)
class Table:
  """One results table: its name (`reproduce <name>`), its config class (the job's config holds
  one as its field `<name>_table`), `build(session, its config, out folder)` and `units(session,
  its config)`, the generations it runs (the progress bar's share of the job)."""

  name: str
  config: type
  build: Callable[[Session, Any, str], Result]
  units: Callable[[Session, Any], int]


def public(records: Sequence[Any]) -> list[dict[str, Any]]:
  """Records (or a table's rows) for JSON: without the generated tokens."""
  return [r.to_json(outputs=False) for r in records]
