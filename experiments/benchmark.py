"""The main job: tau, tokens/s and speedup of every method on the embedded default.

  python -m experiments.benchmark [--config configs/benchmark.py] [--out DIR] [--set key=value]

Writes DIR/results.json (one record per method and dataset), DIR/results.md and PNG plots.
"""

from __future__ import annotations

import argparse

from specjax.benchmark import markdown, run
from specjax.config_utils import load_config


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/benchmark.py")
  parser.add_argument("--out", default=None, help="output folder (default: the config's)")
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
  args = parser.parse_args(argv)
  overrides = list(args.set) + ([f"out={args.out}"] if args.out else [])
  cfg = load_config(args.config, overrides)
  records = run(cfg)
  print()
  print(markdown(records, cfg))
  bad = [f"{r['method']}/{r['dataset']}" for r in records
         if cfg.temperature == 0 and not r["matches_autoregressive"]]
  if bad:
    print(f"WARNING: greedy outputs differ from autoregressive for {bad}")
  print(f"results in {cfg.out}/results.json, results.md, acceptance_by_depth.png, speedup.png")


if __name__ == "__main__":
  main()
