"""Tau of drafters at equal trees on the benchmark's prompts: the deterministic half of a
comparison.

  python -m experiments.compare_drafters --drafter eagle --drafter eagle3 \
      --drafter eagle3=runs/abl_e3_top/export --trees 5,7,7x3x16

Ablations (taps, losses, training budgets) are judged on acceptance, which timing noise cannot
blur: every drafter is run with the same tree shapes (`--trees`, read by each family's
`tree_options`: a chain of d is `d` for every family, EAGLE-2's dynamic tree `depth x top_k x
total_tokens`, a static tree its name) and the same recent tokens, batch 1, T = 0, on the
benchmark's datasets. Tau is emitted tokens over target calls summed over prompts (the
benchmark's figure). Beside it, each folder's held-out top-1 agreement by depth and its chain tau
(1 + sum over d of P(depths 1..d all agree), the acceptance a chain needs), from the training
evaluator run now on the rows its training held out.
"""

from __future__ import annotations

import os

from specjax import assets, cli, compile_cache, drafters, metrics
from specjax.decoding import generate
from specjax.drafters import io, registry
from specjax.interop.hf import load_target
from specjax.lab.benchmark import BenchmarkConfig, load_prompts
from specjax.train.drafter import heldout_scores


def tree_options(spec: str, method: str) -> dict:
  """Tree options of `method` from a short spec (`Family.tree_options`): '7' is a chain of 7 for
  every family; EAGLE-style families read '7x3x16' (depth x top_k x total_tokens), static-tree
  families a tree name."""
  return registry.family(method).tree_options(spec)


def parse_drafter(spec: str) -> tuple[str, str | None]:
  """'eagle3' (the shipped folder) or 'eagle3=path/to/folder'."""
  method, _, path = spec.partition("=")
  return method, path or None


def heldout(method: str, path: str | None, target) -> tuple[str, str]:
  """(held-out agreement by depth, held-out chain tau) of a drafter folder, evaluated now by the
  training evaluator on the rows its run held out; dashes for a folder without metadata."""
  folder = path or io.asset_dir(method)
  if not os.path.isfile(os.path.join(folder, "metadata.json")):
    return "-", "-"
  scores = heldout_scores(folder, target)
  depth = sum(k.startswith("agree_") for k in scores)  # agree_1 .. agree_depth, in depth order
  return (" ".join(f"{scores[f'agree_{d}']:.2f}" for d in range(1, depth + 1)),
          f"{scores['chain_tau']:.2f}")


@cli.usage_errors
def main(argv=None):
  parser = cli.tool_parser(__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--drafter", action="append", required=True,
                      help="method or method=folder; repeat to compare")
  parser.add_argument("--trees", type=cli.names, default=["5", "7"],
                      help="comma-separated tree shapes")
  parser.add_argument("--recent-tokens", type=cli.non_negative_int, default=64)
  parser.add_argument("--datasets", type=cli.names, default=["humaneval", "stdlib_heldout"])
  parser.add_argument("--num-prompts", type=cli.positive_int, default=16)
  parser.add_argument("--max-new-tokens", type=cli.positive_int, default=128)
  args = parser.parse_args(argv)
  compile_cache.from_args(args)
  cfg = BenchmarkConfig(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
  target = load_target(assets.TARGET_DIR, dtype="float32")
  trees = args.trees
  prompts = {ds: load_prompts(target, ds, cfg) for ds in args.datasets}
  for spec in args.drafter:  # every drafter, folder and tree shape, before the first figure
    method, path = parse_drafter(spec)
    for tree in trees:
      try:
        drafters.build(method, target, path=path, recent_tokens=args.recent_tokens,
                       **tree_options(tree, method))
      except ValueError as e:
        raise ValueError(f"--drafter {spec} --trees {tree}: {e}") from None
  print("\n".join(metrics.markdown_table(
      ["drafter", "held-out agreement", "held-out chain tau", "dataset", *trees])))
  for spec in args.drafter:
    method, path = parse_drafter(spec)
    agree, chain = heldout(method, path, target)
    for ds, rows in prompts.items():
      taus = []
      for tree in trees:
        drafter = drafters.build(method, target, path=path, recent_tokens=args.recent_tokens,
                                 **tree_options(tree, method))
        tokens = calls = 0
        for p in rows:
          stats = generate(target, [p], max_new_tokens=args.max_new_tokens, drafter=drafter,
                           eos_token_id=[], pad_to=max(map(len, rows))).stats
          tokens, calls = tokens + stats.new_tokens, calls + stats.target_calls
        taus.append(f"{tokens / calls:.2f}")
      print(metrics.markdown_row([spec, agree, chain, ds, *taus]), flush=True)


if __name__ == "__main__":
  main()
