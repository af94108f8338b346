"""Train a learned drafter (Medusa, Hydra, EAGLE, EAGLE-3) against the frozen target and export it.

  python -m experiments.train_drafter --config configs/eagle3_stdlib.py
  python -m experiments.train_drafter --config configs/medusa_stdlib.py --set optim.total_steps=50

Interrupt it at any time: running the same command again resumes from the last checkpoint in
the config's workdir and reaches the same parameters as an uninterrupted run.
"""

from __future__ import annotations

import json

from specjax import cli
from specjax.train.drafter import train_drafter


def main(argv=None):
  parser = cli.config_parser(__doc__.splitlines()[0], stop_after=True)
  args = parser.parse_args(argv)
  cfg = cli.load_from_args(args)
  summary = train_drafter(cfg, stop_after=args.stop_after)
  if summary["finished"]:
    meta = summary["metadata"]
    print(json.dumps({k: meta[k] for k in ("method", "num_params", "steps", "tokens_seen",
                                           "wall_seconds", "draft_vocab_coverage",
                                           "heldout_agreement_by_depth")}, indent=2))
    print(f"exported to {summary['export_dir']}")
  else:
    print(f"stopped at step {summary['step']} of {cfg.optim.total_steps}; run again to resume")


if __name__ == "__main__":
  main()
