"""Choose a learned drafter's tree on held-out prompts: speed of each tree shape beside AR.

  python -m experiments.tune_tree --method eagle3
  python -m experiments.tune_tree --method eagle3 --path runs/eagle3_stdlib/export --save
  python -m experiments.tune_tree --method medusa --path specjax/assets/medusa --save \
      --overwrite-shipped  # the shipped folder

Trees trade acceptance (tau) for verification cost, which depends on the hardware and the
target's layout: on a 2-core CPU a small target's verify step grows with every node, on an
accelerator it barely does. The target runs on the main job's mesh (`--mesh auto`: split over
every core or device it divides into; `--mesh none` for one device). The sweep runs on held-out
stdlib files (never the HumanEval prompts the main table reports), and
--save writes the fastest option set into the drafter folder's config.json ("tree"), which
`load_drafter` uses unless told otherwise, and the sweep with its provenance into the folder's
tune_tree.json (each file replaced atomically). --save needs an explicit --path, and a --path
(or --out) inside the shipped assets also --overwrite-shipped, checked before measuring: the
shipped folders change only when asked to. The
candidates are the family's own grid (`Family.tune_grid`) unless --candidates names others, each
with the folder's recorded draft vocabulary size (`draft_vocab`) unless --draft-vocab names sizes
to cross them with (e.g. 2048,1024,512).
"""

from __future__ import annotations

import json
import os

from specjax import assets, cli, compile_cache, files, metrics, provenance
from specjax.drafters import io, registry
from specjax.lab import report
from specjax.lab.benchmark import BenchmarkConfig, sweep_trees

# The history's recent tokens join the draft vocabulary each round at almost no cost
# (`recent_tokens`): every candidate gets them.
RECENT_TOKENS = 64
RESULTS = "tune_tree.json"


def default_candidates(method: str) -> list[dict]:
  """The family's own grid (`Family.tune_grid`), each with RECENT_TOKENS recent tokens."""
  return [dict(c, recent_tokens=RECENT_TOKENS) for c in registry.family(method).tune_grid()]


def recorded_draft_vocab(folder: str) -> int | None:
  """The draft vocabulary size a specjax drafter folder records as its default (`draft_vocab`,
  kept when its tree is tuned again), or None."""
  try:
    return io.read_config(folder).get("tree", {}).get("draft_vocab")
  except (OSError, ValueError):  # a published layout records none
    return None


def parse_candidates(text: str) -> list[dict]:
  """`--candidates`: a JSON list of option dicts (a usage error otherwise, before any work)."""
  try:
    candidates = json.loads(text)
  except json.JSONDecodeError as e:
    cli.fail(f"--candidates is not JSON ({e.msg} at column {e.colno}): give a list of option "
             "dicts, e.g. '[{\"depth\": 4, \"top_k\": 2}]'")
  if not isinstance(candidates, list) or not candidates or not all(
      isinstance(c, dict) for c in candidates):
    cli.fail(f"--candidates must be a non-empty JSON list of option dicts, got {text!r}")
  return candidates


@cli.usage_errors
def main(argv=None):
  parser = cli.tool_parser(__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--method", required=True, choices=registry.families())
  parser.add_argument("--num-prompts", type=cli.positive_int, default=8)
  parser.add_argument("--max-new-tokens", type=cli.positive_int, default=128)
  parser.add_argument("--candidates", default=None,
                      help="JSON list of option dicts (default: a grid for the family)")
  parser.add_argument("--save", action="store_true",
                      help="write the fastest options into the --path folder as its default")
  parser.add_argument("--path", default=None,
                      help="drafter folder (default: the shipped one; --save needs it named)")
  parser.add_argument("--draft-vocab", type=cli.positive_ints, default=None,
                      help="comma-separated draft vocabulary sizes crossed with the candidates "
                           "(draft_vocab: the most frequent ids only); default: the folder's "
                           "recorded one, else the whole vocabulary")
  parser.add_argument("--out", default=None, help="also write the sweep as JSON to this file")
  parser.add_argument(assets.OVERWRITE_FLAG, action="store_true",
                      help="let --save or --out write into the shipped assets folder")
  cli.add_mesh_argument(parser)  # auto, as the main job
  args = parser.parse_args(argv)
  if args.save and not args.path:
    cli.fail("--save writes into a drafter folder: name it with --path (e.g. --path "
             f"runs/{args.method}_stdlib/export, or --path specjax/assets/{args.method} "
             f"{assets.OVERWRITE_FLAG} to change the shipped default)")
  try:  # before any measuring
    if args.path and not os.path.isdir(args.path):
      raise ValueError(f"--path {args.path} is not a drafter folder")
    if args.save:
      assets.check_writable(args.path, args.overwrite_shipped, "--save writes --path")
    if args.out:
      files.check_output_file(args.out, "--out file", overwrite_shipped=args.overwrite_shipped)
  except ValueError as e:
    cli.fail(str(e))
  mesh = cli.mesh_from_args(args)
  candidates = (parse_candidates(args.candidates) if args.candidates
                else default_candidates(args.method))
  sizes = args.draft_vocab or [recorded_draft_vocab(args.path or io.asset_dir(args.method))]
  candidates = [dict(c, **({} if k is None else {"draft_vocab": k}))
                for c in candidates for k in sizes]
  for c in candidates:  # a misspelt option fails now, not after the first measurements
    try:
      io.check_tree_options(args.method, c)
    except ValueError as e:
      cli.fail(f"--candidates {json.dumps(c)}: {e}")
  if args.path:
    candidates = [dict(c, path=args.path) for c in candidates]
  cfg = BenchmarkConfig(datasets=("stdlib_heldout",), num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens, profile_repeats=5, mesh=mesh)
  try:
    records = sweep_trees(args.method, candidates, cfg)
  except ValueError as e:  # a drafter folder that does not load, options it refuses
    cli.fail(str(e))
  block = provenance.collect(dict(vars(args), benchmark=cfg))
  print(report.measured_with(provenance.header(block)))
  print("\n".join(metrics.markdown_table(
      ["options", "nodes", "tau", "speedup", "draft ms", "verify ms", "ideal"])))
  for r in records[1:]:
    bad = r.figures.unreliable_figures
    ideal = "n/a" if r.figures.ideal_speedup is None else f"{r.figures.ideal_speedup:.2f}x"
    print(f"| {json.dumps({k: v for k, v in r.options.items() if k != 'path'})} | "
          f"{r.draft_nodes} | {r.tau:.2f} | {r.speedup:.2f}x | "
          f"{report.ms(r.phases.t_draft_ms, 't_draft' in bad)} | "
          f"{report.ms(r.phases.t_verify_ms, 't_verify' in bad)} | "
          f"{ideal}{' ?' * r.figures.unreliable} |")
  print("`?`: an unreliable timing (not positive, or spread across trials too wide)")
  best = max(records[1:], key=lambda r: r.speedup)
  print(f"fastest: {best.options} ({best.speedup:.2f}x, tau {best.tau:.2f})")
  if best.speedup < 1 or best.figures.unreliable:
    print("WARNING: the fastest tree " + ("is slower than autoregressive decoding"
                                          if best.speedup < 1 else "rests on unreliable "
                                          "timings (`?`)") + ": measure on more prompts "
          "(--num-prompts, --max-new-tokens) before trusting it" + (
              ", although --save records it as the folder's default" if args.save else ""))
  summary = {"provenance": block, "method": args.method,
             "best": {k: v for k, v in best.options.items() if k != "path"},
             "records": [r.to_json(outputs=False) for r in records]}
  outs = ([args.out] if args.out else []) + (
      [os.path.join(args.path, RESULTS)] if args.save else [])
  for out in outs:  # each atomically: a failed write keeps the previous file
    files.write_json(out, summary, indent=1, allow_nan=False)
  if args.save:
    io.set_default_tree(args.path, overwrite_shipped=args.overwrite_shipped, **summary["best"])
    print(f"saved as the default tree of {args.path} (sweep in {RESULTS})")


if __name__ == "__main__":
  main()
