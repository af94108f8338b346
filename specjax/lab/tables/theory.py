"""The theory table: Leviathan et al.'s expected tokens per call (1 - a^(g+1)) / (1 - a) and
expected speedup at the measured acceptance and costs, against the measured ones, for chains of
g tokens."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np

from specjax.config_utils import NonEmpty, NonEmptyStr, PosInt, config
from specjax.drafters import registry
from specjax.lab import report
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import AR, TableRow, unreliable_timings
from specjax.lab.session import Result, Session, Table, check_methods, family_of, public

# The model-free and draft-model drafters that draft a chain of a chosen length.
CHAIN_DRAFTERS = ("prompt_lookup", "draft_lm", "layer_skip")


@config
class TheoryTable:
  methods: tuple[NonEmptyStr, ...] = ("draft_lm", "eagle")  # chain drafters
  lengths: Annotated[tuple[PosInt, ...], NonEmpty] = (1, 2, 3, 4, 5, 6, 7, 8)  # chains g

  def check(self, cfg: BenchmarkConfig) -> None:
    check_methods("theory_table.methods", self.methods,
                  [*registry.families(), *CHAIN_DRAFTERS], cfg)


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


@dataclasses.dataclass
class TheoryRow(TableRow):
  """A chain's run and what theory expects of it at its measured acceptance and costs."""

  g: int  # the chain's length
  a: float  # the per-token acceptance fitted to its rounds (`per_token_acceptance`)
  predicted_tokens_per_call: float  # Leviathan et al.'s eq. 1 at a
  unreliable_figures: list[str]  # its phase timings' and AR's that cannot be trusted
  tokens_per_round: float  # measured, each prompt's prefill left out
  leviathan_speedup: float  # eq. 1 over (g c + 1): verifying costs one AR step
  predicted_speedup: float  # eq. 1 x t_AR / (t_draft + t_verify): the measured costs
  cost_ratio: float  # c: one draft step in AR steps
  t_ar_ms: float  # the AR step


def units(s: Session, t: TheoryTable) -> int:
  return len(s.prompts(s.first_dataset)) * len(t.methods) * (len(t.lengths) + 1)


def build(s: Session, t: TheoryTable, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  n = len(s.prompts(dataset))
  records = []
  for method in t.methods:
    runs = [(AR, {})] + [(method, chain_options(method, g, cfg)) for g in t.lengths]
    group = s.measure(dataset, runs, profile=True)
    t_ar = group[0].phases.t_verify_ms
    for g, r in zip(t.lengths, group[1:]):
      a = per_token_acceptance(r.accepted_by_depth, g)
      predicted = expected_tokens(a, g)
      c = r.phases.t_draft_ms / (g * t_ar)  # one draft step in AR steps
      bad = unreliable_timings(r) + [f"autoregressive {x}" for x in unreliable_timings(group[0])]
      records.append(TheoryRow(
          r, g=g, a=a, predicted_tokens_per_call=predicted, unreliable_figures=bad,
          # Each prompt's prefill is a call emitting one token: rounds alone compare with eq. 1.
          tokens_per_round=(r.new_tokens - n) / max(r.target_calls - n, 1),
          leviathan_speedup=predicted / (g * c + 1.0),
          predicted_speedup=predicted * t_ar / (r.phases.t_draft_ms + r.phases.t_verify_ms),
          cost_ratio=c, t_ar_ms=t_ar))
  header = ["method", "g", "a", "E[tokens/call] (1-a^(g+1))/(1-a)", "measured tokens/round",
            "measured tau", "draft ms", "verify ms", "E[speedup] (verify = 1 step)",
            "E[speedup] (measured costs)", "measured speedup"]
  rows = [[r.record.method, r.g, f"{r.a:.3f}", f"{r.predicted_tokens_per_call:.2f}",
           f"{r.tokens_per_round:.2f}", f"{r.record.tau:.2f}",
           report.ms(r.record.phases.t_draft_ms, "t_draft" in r.unreliable_figures),
           report.ms(r.record.phases.t_verify_ms, "t_verify" in r.unreliable_figures),
           f"{r.leviathan_speedup:.2f}x" + report.mark(r.unreliable_figures),
           f"{r.predicted_speedup:.2f}x" + report.mark(r.unreliable_figures),
           f"{r.record.speedup:.2f}x"] for r in records]
  lines = [f"### Theory against measurement: chains on {dataset} (T = 0, {n} prompts x "
           f"{cfg.max_new_tokens} new tokens, batch 1)", ""] + report.table(header, rows) + [
      "a: the per-token acceptance fitted to the rounds (accepted nodes / tested nodes). "
      "Leviathan et al.'s speedup (1 - a^(g+1)) / ((1 - a)(g c + 1)) takes c = draft ms / (g x "
      "the AR step) and assumes verifying g + 1 tokens costs one step; the other uses the "
      "measured verify ms: E[tokens] x t_AR / (t_draft + t_verify). Measured tokens/round leaves "
      "out each prompt's prefill; the last round is cut at the token budget. `?`: a timing "
      "that is not positive or whose spread across trials exceeds half of it, or a figure "
      "resting on one (as in the main job's table).", ""]
  figure = _plot(t, records, os.path.join(out, "theory.png"))
  return Result("\n".join(lines), {"records": public(records)}, [figure])


def _plot(t: TheoryTable, records: list[TheoryRow], path: str) -> str:
  """Tokens per call and speedup against g: each expected one dashed beside the measured one."""
  plt = report.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for method in t.methods:
    mine = [r for r in records if r.record.method == method]
    g = [r.g for r in mine]
    line = axes[0].plot(g, [r.predicted_tokens_per_call for r in mine], "--",
                        label=f"{method} (1-a^(g+1))/(1-a)")[0]
    axes[0].plot(g, [r.tokens_per_round for r in mine], "o-", color=line.get_color(),
                 label=f"{method} measured")
    line = axes[1].plot(g, [r.predicted_speedup for r in mine], "--",
                        label=f"{method} expected (measured costs)")[0]
    axes[1].plot(g, [r.record.speedup for r in mine], "o-", color=line.get_color(),
                 label=f"{method} measured")
  axes[0].set(title="tokens per target call", xlabel="chain length g")
  axes[1].set(title="speedup vs autoregressive", xlabel="chain length g", ylabel="x")
  for ax in axes:
    ax.legend(fontsize=8)
  return report.save(fig, path)


TABLE = Table("theory", TheoryTable, build, units)
