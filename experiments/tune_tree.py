"""Choose a learned drafter's tree on held-out prompts: speed of each tree shape beside AR.

  python -m experiments.tune_tree --method eagle3
  python -m experiments.tune_tree --method medusa --save     # record the best as its default

Trees trade acceptance (tau) for verification cost, which depends on the hardware: on a 2-core
CPU a small target's verify step grows with every node, on an accelerator it barely does. The
sweep runs on held-out stdlib files (never the HumanEval prompts the main table reports), and
--save writes the fastest option set into the drafter folder's config.json ("tree"), which
`load_drafter` uses unless told otherwise. The candidates are the family's own grid
(`Family.tune_grid`) unless --candidates names others.
"""

from __future__ import annotations

import argparse
import json

from specjax.benchmark import BenchmarkConfig, sweep_trees
from specjax.drafters import io, registry

# The history's recent tokens join the draft vocabulary each round at almost no cost
# (`recent_tokens`): every candidate gets them.
RECENT_TOKENS = 64


def default_candidates(method: str) -> list[dict]:
  """The family's own grid (`Family.tune_grid`), each with RECENT_TOKENS recent tokens."""
  return [dict(c, recent_tokens=RECENT_TOKENS) for c in registry.family(method).tune_grid()]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--method", required=True, choices=registry.families())
  parser.add_argument("--num-prompts", type=int, default=8)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--candidates", default=None,
                      help="JSON list of option dicts (default: a grid for the family)")
  parser.add_argument("--save", action="store_true",
                      help="write the fastest options into the drafter folder as its default")
  parser.add_argument("--path", default=None, help="drafter folder (default: the shipped one)")
  args = parser.parse_args(argv)
  candidates = json.loads(args.candidates) if args.candidates else default_candidates(
      args.method)
  if args.path:
    candidates = [dict(c, path=args.path) for c in candidates]
  cfg = BenchmarkConfig(datasets=("stdlib_heldout",), num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens, profile_repeats=5)
  records = sweep_trees(args.method, candidates, cfg)
  print("| options | nodes | tau | speedup | draft ms | verify ms | ideal |")
  print("|---|---|---|---|---|---|---|")
  for r in records[1:]:
    print(f"| {json.dumps({k: v for k, v in r['options'].items() if k != 'path'})} | "
          f"{r['draft_nodes']} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['t_draft_ms']:.2f} | "
          f"{r['t_verify_ms']:.2f} | {r['ideal_speedup']:.2f}x |")
  best = max(records[1:], key=lambda r: r["speedup"])
  print(f"fastest: {best['options']} ({best['speedup']:.2f}x, tau {best['tau']:.2f})")
  if args.save:
    options = {k: v for k, v in best["options"].items() if k != "path"}
    folder = args.path or io.asset_dir(args.method)
    io.set_default_tree(folder, **options)
    print(f"saved as the default tree of {folder}")


if __name__ == "__main__":
  main()
