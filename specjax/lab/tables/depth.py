"""The depth table: the acceptance rate by draft depth of every learned drafter, per dataset."""

from __future__ import annotations

import os

from specjax.config_utils import NonEmptyStr, config
from specjax.drafters import registry
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.report import plot_acceptance, table
from specjax.lab.session import (
  Result,
  Session,
  Table,
  check_methods,
  prompt_counts,
  public,
)


@config
class DepthTable:
  methods: tuple[NonEmptyStr, ...] = ()  # () = every learned drafter of the run

  def check(self, cfg: BenchmarkConfig) -> None:
    check_methods("depth_table.methods", self.methods, registry.families(), cfg)


def units(s: Session, t: DepthTable) -> int:
  return len(s.learned(t.methods)) * sum(len(s.prompts(d)) for d in s.datasets)


def build(s: Session, t: DepthTable, out: str) -> Result:
  methods = s.learned(t.methods)
  if not methods:
    raise ValueError("no learned drafter in this run: name one with --set drafter.<family>=DIR "
                     "or --set depth_table.methods=...")
  records = [r for d in s.datasets for r in s.measure(d, [(m, None) for m in methods])]
  # Up to the deepest depth any round reached (a tree of N nodes is shallower than N).
  depth = max([d + 1 for r in records for d, a in enumerate(r.acceptance_by_depth)
               if a is not None] or [1])
  rows = [[r.method, r.dataset, r.draft_nodes, f"{r.tau:.2f}"]
          + ["-" if a is None else f"{a:.2f}"
             for a in (r.acceptance_by_depth + [None] * depth)[:depth]] for r in records]
  lines = [f"### Acceptance rate by draft depth (T = 0, {prompt_counts(records)} x "
           f"{s.cfg.max_new_tokens} new tokens, each drafter's default tree)", ""]
  lines += table(["drafter", "dataset", "nodes", "tau"] + [f"d={d}" for d in range(1, depth + 1)],
                 rows)
  lines += ["P(the depth-d node of the accepted path is accepted | its parent was), pooled over "
            "rounds; `-`: no round reached that depth.", ""]
  figure = plot_acceptance(records, os.path.join(out, "depth.png"))
  return Result("\n".join(lines), {"records": public(records)}, [figure])


TABLE = Table("depth", DepthTable, build, units)
