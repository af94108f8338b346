"""The tables of `python -m experiments.reproduce <table>`: the paper-style results of this
library, each from one command, on the embedded default or any target and drafters a config
names (the benchmark's fields: `target`, `drafter.<method>`, `datasets`, `prompts`, ...).

Every table measures through `specjax.lab.benchmark.run_methods` (warm-up, interleaved methods,
AR in the same run), so its figures mean what the benchmark's mean. Within one process the runs are
kept (`Session.measure`): `all` measures a configuration once when several tables show it.

  methods  tau and speedup of every method per dataset, T = 0 and T = 1, batch 1 (Spec-Bench /
           EAGLE-3 layout); speedup is the mean and spread over `timing_repeats` passes
  depth    acceptance rate by draft depth of every learned drafter
  theory   Leviathan et al.'s expected tokens per call (1 - a^(g+1)) / (1 - a) and expected
           speedup at the measured acceptance and costs, against the measured ones, chains g
  budget   tau and speedup against tree size for EAGLE and DFlash, with the oracle's roofline
  peers    transformers' generate, assisted generation and prompt lookup beside specjax's
  batch    tokens/s and tau at several batch sizes (rows accept raggedly)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import numpy as np

from specjax import (
  assets,
  config_utils,
  decoding,
  distributed,
  drafters,
  files,
  metrics,
  provenance,
)
from specjax.config_utils import NonEmpty, NonEmptyStr, NonNegFloat, NonNegInt, PosInt, config
from specjax.drafters import registry
from specjax.lab.benchmark import (
  AR,
  BenchmarkConfig,
  add_speedups,
  common_pad,
  configured_target,
  dataset_name,
  datasets_of,
  load_prompts,
  methods_of,
  oracle_roofline,
  plot_acceptance,
  pyplot,
  run_methods,
  unreliable_timings,
)
from specjax.sharding import describe

# The deepest level of the trees of the budget table: the shipped DFlash block's 7 drafted
# positions, and EAGLE-2's default depth.
BUDGET_DEPTH = 7


@config
class ReproduceConfig(BenchmarkConfig):
  """The benchmark's config plus each table's sizes. One-dataset tables (theory, budget, peers,
  batch) use the first dataset."""

  datasets: Annotated[tuple[NonEmptyStr, ...], NonEmpty] = (
      "humaneval", "stdlib_heldout", "stdlib_docstrings")
  num_prompts: PosInt = 4
  max_new_tokens: PosInt = 64
  profile_repeats: PosInt = 20  # loop lengths of the phase timings (theory), the oracle (budget)
  out: NonEmptyStr = "out/reproduce"
  temperatures: Annotated[tuple[NonNegFloat, ...], NonEmpty] = (0.0, 1.0)  # the methods table's
  timing_repeats: PosInt = 3  # passes over the prompts timed by the methods table
  depth_methods: tuple[NonEmptyStr, ...] = ()  # () = every learned drafter of the run
  theory_methods: tuple[NonEmptyStr, ...] = ("draft_lm", "eagle")  # chain drafters
  theory_lengths: Annotated[tuple[PosInt, ...], NonEmpty] = (1, 2, 3, 4, 5, 6, 7, 8)
  budget_methods: tuple[NonEmptyStr, ...] = ("eagle", "dflash")
  budget_nodes: Annotated[tuple[PosInt, ...], NonEmpty] = (1, 2, 4, 8, 16, 32, 64)
  batch_methods: tuple[NonEmptyStr, ...] = ("prompt_lookup", "draft_lm", "eagle")
  batch_sizes: Annotated[tuple[PosInt, ...], NonEmpty] = (1, 4, 16)
  batch_prompts: PosInt = 16
  peer_threads: NonNegInt = 0  # torch threads in the peers table; 0 = the cores JAX's client uses

  def __post_init__(self):
    super().__post_init__()
    labels = sorted(set(self.drafter) - set(drafters.names()))  # folders named by a label
    learned = registry.families()
    for field, allowed in (("depth_methods", learned), ("budget_methods", learned),
                           ("theory_methods", [*learned, *CHAIN_DRAFTERS]),
                           ("batch_methods", [AR, *drafters.names()])):
      for method in getattr(self, field):
        if method not in allowed and method not in labels:
          raise ValueError(f"{field} holds {method!r}, which it cannot run: it takes "
                           f"{sorted(allowed)} or a folder's label (drafter.<label>=DIR)")
    if max(self.batch_sizes) > self.batch_prompts:
      raise ValueError(f"batch_sizes holds {max(self.batch_sizes)}, more than the "
                       f"batch_prompts ({self.batch_prompts}) a batch is made of")


def jax_threads() -> int:
  """The cores XLA's CPU client runs on (its thread pool is sized by the process's affinity)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def is_learned(method: str, cfg: BenchmarkConfig) -> bool:
  """A learned family, or a row label naming a drafter folder (`drafter.<label>=DIR`)."""
  return method in registry.families() or (method in cfg.drafter
                                           and method not in drafters.names())


def family_of(method: str, cfg: BenchmarkConfig) -> str:
  """The registered family behind a row: itself, or for a label the folder's family."""
  if method in drafters.names() or method not in cfg.drafter:
    return method
  from specjax.drafters import io
  from specjax.interop import formats
  path = cfg.drafter[method]
  layout = formats.detect(path)  # a published layout is named after its family
  return io.read_config(path)["method"] if layout == formats.SPECJAX else layout


# The model-free and draft-model drafters that draft a chain of a chosen length.
CHAIN_DRAFTERS = ("prompt_lookup", "draft_lm", "layer_skip")


def chain_options(method: str, g: int, cfg: BenchmarkConfig) -> dict[str, Any]:
  """`method` drafting a chain of g tokens, over the config's other options for it."""
  family = family_of(method, cfg)
  if family in registry.families():
    chain = registry.family(family).tree_options(str(g))
  elif family == "prompt_lookup":
    chain = dict(num_tokens=g, num_branches=1)
  elif family in CHAIN_DRAFTERS:
    chain = dict(num_tokens=g)
  else:
    raise ValueError(f"{method} drafts no chain of a chosen length; chain drafters: draft_lm, "
                     "layer_skip, prompt_lookup and the learned families")
  return {**cfg.options_for(method), **chain}


def tree_options(method: str, nodes: int, cfg: BenchmarkConfig) -> dict[str, Any]:
  """A grown tree of `nodes` nodes for a learned family: a chain up to BUDGET_DEPTH nodes, then
  BUDGET_DEPTH levels with top_k widening with the budget."""
  family = registry.family(family_of(method, cfg))
  if nodes <= BUDGET_DEPTH:
    spec = str(nodes)
  else:
    top_k = 2 if nodes <= 16 else 4 if nodes <= 32 else 8
    spec = f"{BUDGET_DEPTH}x{top_k}x{nodes}"
  return {**cfg.options_for(method), **family.tree_options(spec)}


def prompt_counts(records: Sequence[dict[str, Any]]) -> str:
  """The prompts the records' runs decoded: "4 prompts", or per dataset where they differ (a
  dataset with fewer prompts than the config asks for runs them all)."""
  counts = {r["dataset"]: r["prompts"] for r in records}
  if len(set(counts.values())) == 1:
    return f"{next(iter(counts.values()))} prompts"
  return "prompts " + ", ".join(f"{d}: {n}" for d, n in counts.items())


def spread(values: Sequence[float]) -> float:
  """max - min: the benchmark's ± for timings."""
  return float(max(values) - min(values)) if values else 0.0


class Session:
  """The target, prompts and measurements of one job. `measure` keeps each run's records, so a
  table asking for a run another table made reuses it."""

  def __init__(self, cfg: ReproduceConfig, bar=None):
    self.cfg = cfg
    self.bar = bar
    self.target = configured_target(cfg)
    self.datasets = [dataset_name(d) for d in datasets_of(cfg)]
    self._sources = dict(zip(self.datasets, datasets_of(cfg)))
    self._prompts: dict[tuple[str, int], list[list[int]]] = {}
    self._runs: dict[tuple, tuple[dict[str, Any], int, int, bool]] = {}
    self._groups = 0

  @property
  def first_dataset(self) -> str:
    return self.datasets[0]

  def methods(self) -> list[str]:
    return methods_of(self.cfg, self.target)

  def learned(self) -> list[str]:
    return list(self.cfg.depth_methods) or [m for m in self.methods() if is_learned(m, self.cfg)]

  def prompts(self, dataset: str, n: int | None = None) -> list[list[int]]:
    n = self.cfg.num_prompts if n is None else n
    if (dataset, n) not in self._prompts:
      cfg = dataclasses.replace(self.cfg, num_prompts=n)
      self._prompts[dataset, n] = load_prompts(self.target, self._sources[dataset], cfg)
    return self._prompts[dataset, n]

  @functools.cached_property
  def pad_to(self) -> int:
    """One padded prompt length for every table (`common_pad` over the datasets' prompts): each
    method runs one compiled program in the whole job."""
    return common_pad(self.target, [self.prompts(d) for d in self.datasets])

  def measure(self, dataset: str, runs: Sequence[tuple[str, dict[str, Any] | None]], *,
              temperature: float = 0.0, repeats: int = 1, profile: bool = False,
              batch_size: int = 1, num_prompts: int | None = None) -> list[dict[str, Any]]:
    """`run_methods` records of `runs` on `dataset`, with speedups when AR is among them. Kept
    runs are reused when every one is there, timed as often and profiled if asked, and (for
    speedups) from one run."""
    n = len(self.prompts(dataset, num_prompts))
    keys = [(dataset, float(temperature), batch_size, n, m, json.dumps(o, sort_keys=True))
            for m, o in runs]
    kept = [self._runs.get(k) for k in keys]
    usable = all(k is not None and k[2] >= repeats and (k[3] or not profile) for k in kept)
    if usable and (len({k[1] for k in kept}) == 1 or all(m != AR for m, _ in runs)):
      return [dict(k[0]) for k in kept]
    cfg = dataclasses.replace(self.cfg, temperature=float(temperature))
    records = [dict(r, dataset=dataset, temperature=float(temperature), options=o)
               for r, (_, o) in zip(run_methods(
                   self.target, runs, self.prompts(dataset, num_prompts), cfg, self.bar,
                   repeats=repeats, profile=profile, batch_size=batch_size, pad_to=self.pad_to),
               runs)]
    if any(m == AR for m, _ in runs):
      add_speedups(records)
    self._groups += 1
    for k, r in zip(keys, records):
      self._runs[k] = (r, self._groups, repeats, profile)
    return [dict(r) for r in records]


@dataclasses.dataclass(frozen=True)
class Result:
  """What a table writes: its Markdown (without the provenance line), JSON payload, figures."""

  markdown: str
  payload: dict[str, Any]
  figures: list[str]


def _public(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Records for JSON: without the generated tokens."""
  return [{k: v for k, v in r.items() if k != "outputs"} for r in records]


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  return [*metrics.markdown_table(header, rows), ""]


def _speedup_cell(r: dict[str, Any]) -> str:
  s = r["speedup_repeats"]
  return f"{np.mean(s):.2f}x ±{spread(s):.2f}"


def _mark(r: dict[str, Any]) -> str:
  return " ?" if r["unreliable_figures"] else ""


def _ms(r: dict[str, Any], phase: str) -> str:
  """A phase's ms per round, `?` when `unreliable_timings` says it cannot be trusted."""
  return f"{r[f'{phase}_ms']:.2f}" + (" ?" if phase in r["unreliable_figures"] else "")


def _save(fig, path: str) -> str:
  """The table's figure, written atomically (a failed write keeps the previous PNG)."""
  fig.tight_layout()
  try:
    files.save_figure(fig, path, dpi=120)
  finally:
    pyplot().close(fig)
  return path


# -- 1. methods ------------------------------------------------------------------------------


def methods_units(s: Session) -> int:
  cfg = s.cfg
  return (len(cfg.temperatures) * len(s.methods()) * cfg.timing_repeats
          * sum(len(s.prompts(d)) for d in s.datasets))


def methods_table(s: Session, out: str) -> Result:
  cfg, methods = s.cfg, s.methods()
  records = [r for t in cfg.temperatures for d in s.datasets
             for r in s.measure(d, [(m, None) for m in methods], temperature=t,
                                repeats=cfg.timing_repeats)]
  header = ["T", "method"] + [f"{d} {what}" for d in s.datasets for what in ("tau", "speedup")]
  header += ["mean tau", "mean speedup"]
  rows, differ = [], []
  for t in cfg.temperatures:
    for m in methods:
      mine = [r for r in records if r["temperature"] == float(t) and r["method"] == m]
      cells = [f"{float(t):g}", m]
      for r in mine:
        cells += [f"{r['tau']:.2f}", _speedup_cell(r)]
        if float(t) == 0 and not r["matches_autoregressive"]:
          differ.append(f"{m}/{r['dataset']}")
      cells += [f"{np.mean([r['tau'] for r in mine]):.2f}",
                f"{np.mean([np.mean(r['speedup_repeats']) for r in mine]):.2f}x"]
      rows.append(cells)
  ar = [f"{r['dataset']} T={r['temperature']:g}: {r['tokens_per_second']:.0f}"
        for r in records if r["method"] == AR]
  lines = [f"### Methods ({prompt_counts(records)} x {cfg.max_new_tokens} new tokens per "
           f"dataset, batch 1)", ""] + _table(header, rows) + [
      f"Speedup: over autoregressive decoding in the same run, mean ± spread (max - min) over "
      f"{cfg.timing_repeats} timed passes; tau is emitted tokens per target call (one pass: the "
      f"same seeds give the same tokens). Autoregressive tokens/s: {', '.join(ar)}.",
      "Greedy (T = 0) outputs equal autoregressive decoding's for every method"
      if not differ else f"WARNING: greedy outputs differ from autoregressive for {differ}", ""]
  plt = pyplot()
  fig, axes = plt.subplots(1, len(cfg.temperatures), figsize=(7 * len(cfg.temperatures), 4),
                           squeeze=False)
  width = 0.8 / len(s.datasets)
  for ax, t in zip(axes[0], cfg.temperatures):
    x = np.arange(len(methods))
    for i, d in enumerate(s.datasets):
      mine = [next(r for r in records if r["temperature"] == float(t) and r["dataset"] == d
                   and r["method"] == m) for m in methods]
      ax.bar(x + (i - (len(s.datasets) - 1) / 2) * width,
             [np.mean(r["speedup_repeats"]) for r in mine], width, label=d,
             yerr=[[np.mean(r["speedup_repeats"]) - min(r["speedup_repeats"]) for r in mine],
                   [max(r["speedup_repeats"]) - np.mean(r["speedup_repeats"]) for r in mine]])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, methods, rotation=30, ha="right")
    ax.set(title=f"speedup vs autoregressive, T = {float(t):g}", ylabel="x")
    ax.legend()
  figure = _save(fig, os.path.join(out, "methods.png"))
  return Result("\n".join(lines), {"records": _public(records), "differ": differ}, [figure])


# -- 2. depth --------------------------------------------------------------------------------


def depth_units(s: Session) -> int:
  return len(s.learned()) * sum(len(s.prompts(d)) for d in s.datasets)


def depth_table(s: Session, out: str) -> Result:
  learned = s.learned()
  if not learned:
    raise ValueError("no learned drafter in this run: name one with --set drafter.<family>=DIR "
                     "or --set depth_methods=...")
  records = [r for d in s.datasets for r in s.measure(d, [(m, None) for m in learned])]
  # Up to the deepest depth any round reached (a tree of N nodes is shallower than N).
  depth = max([d + 1 for r in records for d, a in enumerate(r["acceptance_by_depth"])
               if a is not None] or [1])
  rows = [[r["method"], r["dataset"], r["draft_nodes"], f"{r['tau']:.2f}"]
          + ["-" if a is None else f"{a:.2f}"
             for a in (r["acceptance_by_depth"] + [None] * depth)[:depth]] for r in records]
  lines = [f"### Acceptance rate by draft depth (T = 0, {prompt_counts(records)} x "
           f"{s.cfg.max_new_tokens} new tokens, each drafter's default tree)", ""]
  lines += _table(["drafter", "dataset", "nodes", "tau"] + [f"d={d}" for d in range(1, depth + 1)],
                  rows)
  lines += ["P(the depth-d node of the accepted path is accepted | its parent was), pooled over "
            "rounds; `-`: no round reached that depth.", ""]
  figure = plot_acceptance(records, os.path.join(out, "depth.png"))
  return Result("\n".join(lines), {"records": _public(records)}, [figure])


# -- 3. theory -------------------------------------------------------------------------------


def theory_units(s: Session) -> int:
  cfg = s.cfg
  return len(s.prompts(s.first_dataset)) * len(cfg.theory_methods) * (len(cfg.theory_lengths) + 1)


def per_token_acceptance(hist: Sequence[int], g: int) -> float:
  """The i.i.d. acceptance a that fits a chain of g best (its maximum-likelihood estimate): the
  nodes accepted over the nodes a round put to the test (the first rejection ends a round)."""
  hist = np.asarray(hist, np.int64)
  reached = hist[::-1].cumsum()[::-1]  # reached[d]: rounds that accepted >= d nodes
  tested = reached[:g].sum()
  return float(reached[1:g + 1].sum() / tested) if tested else 0.0


def expected_tokens(a: float, g: int) -> float:
  """Leviathan et al., eq. 1: expected tokens per target call of a chain of g at acceptance a."""
  return g + 1.0 if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)


def theory_table(s: Session, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  n = len(s.prompts(dataset))
  records = []
  for method in cfg.theory_methods:
    runs = [(AR, {})] + [(method, chain_options(method, g, cfg)) for g in cfg.theory_lengths]
    group = s.measure(dataset, runs, profile=True)
    t_ar = group[0]["t_verify_ms"]
    for g, r in zip(cfg.theory_lengths, group[1:]):
      a = per_token_acceptance(r["accepted_by_depth"], g)
      predicted = expected_tokens(a, g)
      c = r["t_draft_ms"] / (g * t_ar)  # one draft step in AR steps
      bad = unreliable_timings(r) + [f"autoregressive {t}" for t in unreliable_timings(group[0])]
      records.append(dict(
          r, g=g, a=a, predicted_tokens_per_call=predicted, unreliable_figures=bad,
          # Each prompt's prefill is a call emitting one token: rounds alone compare with eq. 1.
          tokens_per_round=(r["new_tokens"] - n) / max(r["target_calls"] - n, 1),
          leviathan_speedup=predicted / (g * c + 1.0),
          predicted_speedup=predicted * t_ar / (r["t_draft_ms"] + r["t_verify_ms"]),
          cost_ratio=c, t_ar_ms=t_ar))
  header = ["method", "g", "a", "E[tokens/call] (1-a^(g+1))/(1-a)", "measured tokens/round",
            "measured tau", "draft ms", "verify ms", "E[speedup] (verify = 1 step)",
            "E[speedup] (measured costs)", "measured speedup"]
  rows = [[r["method"], r["g"], f"{r['a']:.3f}", f"{r['predicted_tokens_per_call']:.2f}",
           f"{r['tokens_per_round']:.2f}", f"{r['tau']:.2f}", _ms(r, "t_draft"),
           _ms(r, "t_verify"), f"{r['leviathan_speedup']:.2f}x" + _mark(r),
           f"{r['predicted_speedup']:.2f}x" + _mark(r), f"{r['speedup']:.2f}x"] for r in records]
  lines = [f"### Theory against measurement: chains on {dataset} (T = 0, {n} prompts x "
           f"{cfg.max_new_tokens} new tokens, batch 1)", ""] + _table(header, rows) + [
      "a: the per-token acceptance fitted to the rounds (accepted nodes / tested nodes). "
      "Leviathan et al.'s speedup (1 - a^(g+1)) / ((1 - a)(g c + 1)) takes c = draft ms / (g x "
      "the AR step) and assumes verifying g + 1 tokens costs one step; the other uses the "
      "measured verify ms: E[tokens] x t_AR / (t_draft + t_verify). Measured tokens/round leaves "
      "out each prompt's prefill; the last round is cut at the token budget. `?`: a timing "
      "that is not positive or whose spread across trials exceeds half of it, or a figure "
      "resting on one (as in the main job's table).", ""]
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for method in cfg.theory_methods:
    mine = [r for r in records if r["method"] == method]
    g = [r["g"] for r in mine]
    line = axes[0].plot(g, [r["predicted_tokens_per_call"] for r in mine], "--",
                        label=f"{method} (1-a^(g+1))/(1-a)")[0]
    axes[0].plot(g, [r["tokens_per_round"] for r in mine], "o-", color=line.get_color(),
                 label=f"{method} measured")
    line = axes[1].plot(g, [r["predicted_speedup"] for r in mine], "--",
                        label=f"{method} expected (measured costs)")[0]
    axes[1].plot(g, [r["speedup"] for r in mine], "o-", color=line.get_color(),
                 label=f"{method} measured")
  axes[0].set(title="tokens per target call", xlabel="chain length g")
  axes[1].set(title="speedup vs autoregressive", xlabel="chain length g", ylabel="x")
  for ax in axes:
    ax.legend(fontsize=8)
  figure = _save(fig, os.path.join(out, "theory.png"))
  return Result("\n".join(lines), {"records": _public(records)}, [figure])


# -- 4. budget -------------------------------------------------------------------------------


def budget_units(s: Session) -> int:
  cfg = s.cfg
  return (len(s.prompts(s.first_dataset)) * len(cfg.budget_methods) * (len(cfg.budget_nodes) + 1)
          + len(cfg.budget_nodes))


def budget_table(s: Session, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  records = []
  for method in cfg.budget_methods:
    runs = [(AR, {})] + [(method, tree_options(method, n, cfg)) for n in cfg.budget_nodes]
    try:
      records += s.measure(dataset, runs)[1:]
    except ValueError as e:  # a budget the family's trees cannot have, say
      raise ValueError(f"budget table, {method} at budget_nodes {list(cfg.budget_nodes)}: "
                       f"{e}") from None
  prompt = s.prompts(dataset)[0]
  roof = oracle_roofline(s.target, prompt, cfg.budget_nodes, cfg.max_new_tokens,
                         cfg.profile_repeats)
  if s.bar is not None:
    s.bar.update(len(cfg.budget_nodes))
  header = ["nodes"] + [f"{m} {what}" for m in cfg.budget_methods for what in ("tau", "speedup")]
  header += ["oracle tau", "oracle verify / AR step", "oracle speedup", "oracle bound"]
  by = {(r["method"], r["options"].get("total_tokens")): r for r in records}
  rows = []
  for i, n in enumerate(cfg.budget_nodes):
    cells: list[Any] = [n]
    for m in cfg.budget_methods:
      r = by[m, n]
      cells += [f"{r['tau']:.2f}", f"{r['speedup']:.2f}x"]
    o = roof["rows"][i]
    rows.append(cells + [f"{o['tau']:.2f}", f"{o['cost']:.2f}", f"{o['speedup']:.2f}x",
                         f"{o['bound_e2e']:.2f}x"])
  best = {m: max((r for r in records if r["method"] == m), key=lambda r: r["speedup"])
          for m in cfg.budget_methods}
  best_oracle = max(roof["rows"], key=lambda o: o["speedup"])
  lines = [f"### Tree budget on {dataset} (T = 0, {len(s.prompts(dataset))} prompts x "
           f"{cfg.max_new_tokens} new tokens, batch 1)", ""] + _table(header, rows) + [
      f"Trees: a chain up to {BUDGET_DEPTH} nodes, then {BUDGET_DEPTH} levels with top_k 2 "
      "(<= 16 nodes), 4 (<= 32) or 8. The oracle drafts the target's own greedy continuation "
      "of the first prompt as a chain of that many nodes (every node accepted): verify / AR "
      "step is what checking N + 1 tokens costs in autoregressive steps, its bound t_AR x "
      "tokens / t_verify with the prefill both pay (`experiments.bench_roofline`): no drafter "
      "of that size can beat it on this machine.",
      "Fastest here: " + ", ".join(f"{m} at {r['draft_nodes']} nodes ({r['speedup']:.2f}x)"
                                   for m, r in best.items())
      + f"; the oracle at {best_oracle['n']} ({best_oracle['speedup']:.2f}x).", ""]
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for m in cfg.budget_methods:
    mine = [by[m, n] for n in cfg.budget_nodes]
    axes[0].plot(cfg.budget_nodes, [r["tau"] for r in mine], "o-", label=m)
    axes[1].plot(cfg.budget_nodes, [r["speedup"] for r in mine], "o-", label=m)
  axes[0].plot(cfg.budget_nodes, [o["tau"] for o in roof["rows"]], "k--", label="oracle")
  axes[1].plot(cfg.budget_nodes, [o["speedup"] for o in roof["rows"]], "k--", label="oracle")
  axes[1].plot(cfg.budget_nodes, [o["bound_e2e"] for o in roof["rows"]], "k:",
               label="oracle bound")
  axes[1].axhline(1.0, color="gray", lw=0.8)
  for ax, what in zip(axes, ("tau", "speedup vs autoregressive")):
    ax.set(title=what, xlabel="draft tree nodes", xscale="log")
    ax.legend()
  figure = _save(fig, os.path.join(out, "budget.png"))
  return Result("\n".join(lines), {"records": _public(records), "oracle": roof}, [figure])


# -- 5. peers --------------------------------------------------------------------------------

PEER_METHODS = (AR, "draft_lm", "prompt_lookup")


def peers_units(s: Session) -> int:
  return len(s.prompts(s.first_dataset)) * 2 * len(PEER_METHODS)


def _hf_runs(s: Session, prompts: Sequence[list[int]], threads: int) -> list[dict[str, Any]]:
  """transformers' greedy generate, assisted generation with the draft LM and prompt lookup on
  the same checkpoint and prompts, interleaved prompt by prompt after one warm-up each."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ValueError(f"the peers table runs transformers beside specjax and needs torch and "
                     f"transformers ({e}); install them with pip install -e \".[test]\"") from None
  log = transformers.logging
  threads_before, verbosity_before = torch.get_num_threads(), log.get_verbosity()
  bars_before = log.is_progress_bar_enabled()
  torch.set_num_threads(threads)
  # Under reproduce's own progress bar: no loading bars, and no warning that transformers'
  # assisted generation raises about its own call to the assistant's `generate`.
  log.disable_progress_bar()
  log.set_verbosity_error()
  try:
    return _hf_measure(s, prompts, torch, transformers)
  finally:
    torch.set_num_threads(threads_before)
    log.set_verbosity(verbosity_before)
    if bars_before:
      log.enable_progress_bar()


def _hf_measure(s: Session, prompts, torch, transformers) -> list[dict[str, Any]]:
  cfg = s.cfg
  draft_lm_options = {**registry.defaults("draft_lm"), **cfg.options_for("draft_lm")}
  lookup_options = {**registry.defaults("prompt_lookup"), **cfg.options_for("prompt_lookup")}
  load = transformers.AutoModelForCausalLM.from_pretrained
  model = load(cfg.target or assets.TARGET_DIR, dtype=torch.float32).eval()
  draft = load(cfg.drafter.get("draft_lm", assets.DRAFT_LM_DIR), dtype=torch.float32).eval()
  draft.generation_config.num_assistant_tokens = draft_lm_options["num_tokens"]
  draft.generation_config.num_assistant_tokens_schedule = "constant"
  # transformers stops drafting early below this draft probability (0.4 by default); specjax's
  # draft LM always drafts its num_tokens, and 0 turns the early stop off: the same algorithm.
  draft.generation_config.assistant_confidence_threshold = 0.0
  calls = [0]
  model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
  n = cfg.max_new_tokens
  runs = {AR: {}, "draft_lm": {"assistant_model": draft},
          "prompt_lookup": {"prompt_lookup_num_tokens": lookup_options["num_tokens"],
                            "max_matching_ngram_size": lookup_options["max_ngram"]}}

  def one(prompt, extra):
    calls[0] = 0
    start = time.perf_counter()
    with torch.no_grad():
      ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
    return ids[0, len(prompt):].tolist(), time.perf_counter() - start, calls[0]

  acc = {m: {"outputs": [], "wall": 0.0, "calls": 0} for m in runs}
  for extra in runs.values():
    one(prompts[0], extra)  # warm-up
  for prompt in prompts:
    for m, extra in runs.items():
      tokens, wall, c = one(prompt, extra)
      acc[m]["outputs"].append(tokens)
      acc[m]["wall"] += wall
      acc[m]["calls"] += c
      if s.bar is not None:
        s.bar.update(1)
  records = []
  for m, a in acc.items():
    new = sum(map(len, a["outputs"]))
    records.append({"implementation": f"transformers {transformers.__version__}", "method": m,
                    "tokens_per_second": new / a["wall"], "tau": new / a["calls"],
                    "target_calls": a["calls"], "new_tokens": new, "outputs": a["outputs"],
                    "torch_threads": torch.get_num_threads()})
  return records


def peers_table(s: Session, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  prompts = s.prompts(dataset)
  ours = [dict(r, implementation="specjax") for r in
          s.measure(dataset, [(m, None) for m in PEER_METHODS])]
  threads = cfg.peer_threads or jax_threads()
  theirs = _hf_runs(s, prompts, threads)
  reference = ours[0]["outputs"]
  for group in (ours, theirs):
    for r in group:
      r["speedup_over_own_greedy"] = r["tokens_per_second"] / group[0]["tokens_per_second"]
      r["matches_specjax_greedy"] = r["outputs"] == reference
  records = ours + theirs
  names = {AR: "greedy", "draft_lm": "draft LM", "prompt_lookup": "prompt lookup"}
  hf_names = {AR: "greedy `generate`", "draft_lm": "assisted generation (`assistant_model=`)",
              "prompt_lookup": "prompt lookup (`prompt_lookup_num_tokens=`)"}
  rows = [[r["implementation"],
           (names if r["implementation"] == "specjax" else hf_names)[r["method"]],
           f"{r['tokens_per_second']:.1f}",
           f"{r['tau']:.2f}", f"{r['speedup_over_own_greedy']:.2f}x",
           "yes" if r["matches_specjax_greedy"] else "no"] for r in records]
  lines = [f"### specjax beside transformers on {dataset} (T = 0, {len(prompts)} prompts x "
           f"{cfg.max_new_tokens} new tokens, batch 1, same checkpoint)", ""]
  lines += _table(["implementation", "method", "tokens/s", "tau", "speedup over its own greedy",
                   "output = specjax greedy"], rows)
  lines += [f"torch runs on {threads} threads, the number of cores JAX's CPU client uses "
            f"({jax_threads()} here); specjax on {describe(s.target.mesh)} (the config's mesh: "
            "auto splits the target over every core). Both draft with the same draft LM and the "
            "same number of tokens (transformers' constant schedule, its early stop on draft "
            "confidence off) and look up the same n-gram sizes. tau for transformers counts the "
            "target's forward calls (prefill included), as specjax's does.", ""]
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(8, 4))
  x = np.arange(len(PEER_METHODS))
  for i, group in enumerate((ours, theirs)):
    ax.bar(x + (i - 0.5) * 0.4, [r["tokens_per_second"] for r in group], 0.4,
           label=group[0]["implementation"])
  ax.set_xticks(x, [names[m] for m in PEER_METHODS])
  ax.set(title="tokens/s, same checkpoint and prompts", ylabel="tokens/s")
  ax.legend()
  figure = _save(fig, os.path.join(out, "peers.png"))
  return Result("\n".join(lines), {"records": _public(records), "torch_threads": threads},
                [figure])


# -- 6. batch --------------------------------------------------------------------------------


def batch_units(s: Session) -> int:
  cfg = s.cfg
  n = len(s.prompts(s.first_dataset, cfg.batch_prompts))
  reference = 0 if 1 in cfg.batch_sizes else n  # batch-1 AR, measured for the comparison
  return sum(math.ceil(n / b) for b in cfg.batch_sizes) * (len(cfg.batch_methods) + 1) + reference


def batch_table(s: Session, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  methods = [AR] + [m for m in cfg.batch_methods if m != AR]
  records = [r for b in cfg.batch_sizes for r in s.measure(
      dataset, [(m, None) for m in methods], batch_size=b, num_prompts=cfg.batch_prompts)]
  # Batch-1 autoregressive decoding is the reference every output is compared with, measured
  # for it when the table's sizes leave batch 1 out.
  ar1 = [r for r in records if r["method"] == AR and r["batch_size"] == 1] or s.measure(
      dataset, [(AR, None)], batch_size=1, num_prompts=cfg.batch_prompts)
  reference = ar1[0]["outputs"]
  rows = []
  for m in methods:
    cells: list[Any] = [m]
    for b in cfg.batch_sizes:
      r = next(r for r in records if r["method"] == m and r["batch_size"] == b)
      r["matches_batch1_autoregressive"] = r["outputs"] == reference
      cells += [f"{r['tokens_per_second']:.0f}", f"{r['tau']:.2f}", f"{r['speedup']:.2f}x"]
    rows.append(cells)
  differ = [f"{r['method']}@{r['batch_size']}" for r in records
            if r.get("matches_batch1_autoregressive") is False]
  n = len(s.prompts(dataset, cfg.batch_prompts))
  header = ["method"] + [f"batch {b} {what}" for b in cfg.batch_sizes
                         for what in ("tokens/s", "tau", "speedup")]
  lines = [f"### Batch size on {dataset} (T = 0, {n} prompts x {cfg.max_new_tokens} new "
           "tokens)", ""] + _table(header, rows) + [
      "tokens/s: every row's new tokens over the wall time; each row of a batch accepts its "
      "own number of draft tokens per round (ragged acceptance), and the batch's round waits for "
      "none of them. Speedup: over autoregressive decoding at the same batch size.",
      "Every output equals batch-1 autoregressive decoding's" if not differ
      else f"Outputs that differ from batch-1 autoregressive decoding: {differ}", ""]
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for m in methods:
    mine = [next(r for r in records if r["method"] == m and r["batch_size"] == b)
            for b in cfg.batch_sizes]
    axes[0].plot(cfg.batch_sizes, [r["tokens_per_second"] for r in mine], "o-", label=m)
    axes[1].plot(cfg.batch_sizes, [r["tau"] for r in mine], "o-", label=m)
  for ax, what in zip(axes, ("tokens/s", "tau")):
    ax.set(title=what, xlabel="batch size", xscale="log")
    ax.legend()
  figure = _save(fig, os.path.join(out, "batch.png"))
  return Result("\n".join(lines), {"records": _public(records), "differ": differ}, [figure])


# -- running ---------------------------------------------------------------------------------

TABLES: dict[str, tuple[Callable[[Session, str], Result], Callable[[Session], int]]] = {
    "methods": (methods_table, methods_units),
    "depth": (depth_table, depth_units),
    "theory": (theory_table, theory_units),
    "budget": (budget_table, budget_units),
    "peers": (peers_table, peers_units),
    "batch": (batch_table, batch_units),
}


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
    ends = np.cumsum([TABLES[n][1](session) for n in names])
    bar.total = int(ends[-1]) if len(ends) else 0
    bar.refresh()
    for name, end in zip(names, ends):
      bar.set_postfix(table=name)
      start = time.perf_counter()
      result = TABLES[name][0](session, cfg.out)
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
    group.write_text(md, f"Measured with {provenance.header(block)}\n\n{result.markdown}\n"
                     f"Table time: {seconds:.0f} s.\n")
    group.write_json(js, {"table": name, "config": config_utils.to_dict(cfg),
                          "provenance": block, "seconds": seconds, **result.payload},
                     indent=1, allow_nan=False)
  return [md, js]
