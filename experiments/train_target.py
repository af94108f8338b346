"""Train a causal LM on the stdlib-code corpus and export it in Hugging Face format.

  python -m experiments.train_target --config configs/target_stdlib.py
  python -m experiments.train_target --config configs/draft_lm_stdlib.py
  python -m experiments.train_target --config configs/target_stdlib.py --set optim.total_steps=50

Interrupt it at any time: running the same command again resumes from the last checkpoint in
the config's workdir and reaches the same parameters as an uninterrupted run.
"""

from __future__ import annotations

import json

from specjax import cli
from specjax.train.target_lm import train_lm


def main(argv=None):
  parser = cli.config_parser(__doc__.splitlines()[0], default_config="configs/target_stdlib.py",
                             stop_after=True)
  args = parser.parse_args(argv)
  cfg = cli.load_from_args(args)
  summary = train_lm(cfg, stop_after=args.stop_after)
  if summary["finished"]:
    meta = summary["metadata"]
    print(json.dumps({k: meta[k] for k in ("num_params", "steps", "tokens_seen", "wall_seconds",
                                           "heldout_loss", "unigram_baseline_loss")}, indent=2))
    print(f"exported to {summary['export_dir']}")
  else:
    print(f"stopped at step {summary['step']} of {cfg.optim.total_steps}; run again to resume")


if __name__ == "__main__":
  main()
