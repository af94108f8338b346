"""The budget table: tau and speedup against tree size for learned drafters (EAGLE and DFlash by
default), with the oracle's roofline beside them: where this hardware's optimum lies."""

from __future__ import annotations

import os
from typing import Annotated, Any

from specjax.config_utils import NonEmpty, NonEmptyStr, PosInt, config
from specjax.drafters import registry
from specjax.lab import report
from specjax.lab.benchmark import oracle_roofline
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import AR
from specjax.lab.session import Result, Session, Table, check_methods, family_of, public

# The deepest level of the trees of the table: the shipped DFlash block's 7 drafted positions,
# and EAGLE-2's default depth.
BUDGET_DEPTH = 7


@config
class BudgetTable:
  methods: tuple[NonEmptyStr, ...] = ("eagle", "dflash")  # learned drafters
  nodes: Annotated[tuple[PosInt, ...], NonEmpty] = (1, 2, 4, 8, 16, 32, 64)  # tree sizes

  def check(self, cfg: BenchmarkConfig) -> None:
    check_methods("budget_table.methods", self.methods, registry.families(), cfg)


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


def units(s: Session, t: BudgetTable) -> int:
  return len(s.prompts(s.first_dataset)) * len(t.methods) * (len(t.nodes) + 1) + len(t.nodes)


def build(s: Session, t: BudgetTable, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  records = []
  for method in t.methods:
    runs = [(AR, {})] + [(method, tree_options(method, n, cfg)) for n in t.nodes]
    try:
      records += s.measure(dataset, runs)[1:]
    except ValueError as e:  # a budget the family's trees cannot have, say
      raise ValueError(f"budget table, {method} at budget_table.nodes {list(t.nodes)}: "
                       f"{e}") from None
  prompt = s.prompts(dataset)[0]
  roof = oracle_roofline(s.target, prompt, t.nodes, cfg.max_new_tokens, cfg.profile_repeats)
  if s.bar is not None:
    s.bar.update(len(t.nodes))
  header = ["nodes"] + [f"{m} {what}" for m in t.methods for what in ("tau", "speedup")]
  header += ["oracle tau", "oracle verify / AR step", "oracle speedup", "oracle bound"]
  by = {(r.method, r.options.get("total_tokens")): r for r in records}
  rows = []
  for i, n in enumerate(t.nodes):
    cells: list[Any] = [n]
    for m in t.methods:
      r = by[m, n]
      cells += [f"{r.tau:.2f}", f"{r.speedup:.2f}x"]
    o = roof.rows[i]
    rows.append(cells + [f"{o.tau:.2f}", f"{o.cost:.2f}", f"{o.speedup:.2f}x",
                         f"{o.bound_e2e:.2f}x"])
  best = {m: max((r for r in records if r.method == m), key=lambda r: r.speedup)
          for m in t.methods}
  best_oracle = max(roof.rows, key=lambda o: o.speedup)
  lines = [f"### Tree budget on {dataset} (T = 0, {len(s.prompts(dataset))} prompts x "
           f"{cfg.max_new_tokens} new tokens, batch 1)", ""] + report.table(header, rows) + [
      f"Trees: a chain up to {BUDGET_DEPTH} nodes, then {BUDGET_DEPTH} levels with top_k 2 "
      "(<= 16 nodes), 4 (<= 32) or 8. The oracle drafts the target's own greedy continuation "
      "of the first prompt as a chain of that many nodes (every node accepted): verify / AR "
      "step is what checking N + 1 tokens costs in autoregressive steps, its bound t_AR x "
      "tokens / t_verify with the prefill both pay (`experiments.bench_roofline`): no drafter "
      "of that size can beat it on this machine.",
      "Fastest here: " + ", ".join(f"{m} at {r.draft_nodes} nodes ({r.speedup:.2f}x)"
                                   for m, r in best.items())
      + f"; the oracle at {best_oracle.n} ({best_oracle.speedup:.2f}x).", ""]
  figure = _plot(t, by, roof, os.path.join(out, "budget.png"))
  return Result("\n".join(lines), {"records": public(records), "oracle": roof.to_json()}, [figure])


def _plot(t: BudgetTable, by, roof, path: str) -> str:
  """tau and speedup against the tree's nodes, a line per drafter and the oracle's beside."""
  plt = report.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  for m in t.methods:
    mine = [by[m, n] for n in t.nodes]
    axes[0].plot(t.nodes, [r.tau for r in mine], "o-", label=m)
    axes[1].plot(t.nodes, [r.speedup for r in mine], "o-", label=m)
  axes[0].plot(t.nodes, [o.tau for o in roof.rows], "k--", label="oracle")
  axes[1].plot(t.nodes, [o.speedup for o in roof.rows], "k--", label="oracle")
  axes[1].plot(t.nodes, [o.bound_e2e for o in roof.rows], "k:", label="oracle bound")
  axes[1].axhline(1.0, color="gray", lw=0.8)
  for ax, what in zip(axes, ("tau", "speedup vs autoregressive")):
    ax.set(title=what, xlabel="draft tree nodes", xscale="log")
    ax.legend()
  return report.save(fig, path)


TABLE = Table("budget", BudgetTable, build, units)
