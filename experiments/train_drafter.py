"""Train a learned drafter (Medusa, Hydra, EAGLE, EAGLE-3, DFlash) against the frozen target.

  python -m experiments.train_drafter --config configs/eagle3_stdlib.py
  python -m experiments.train_drafter --config configs/medusa_stdlib.py --set optim.total_steps=50
  python -m experiments.train_drafter --config configs/eagle3_stdlib.py --set family.frozen_head=1

A family's own options are its `family` group (`--set family.<option>=...`); `--help` with a
`--config` lists them, and an option the family does not have is refused, naming its options.

Interrupt it at any time: running the same command again resumes from the last checkpoint in
the config's workdir and reaches the same parameters as an uninterrupted run.
"""

from __future__ import annotations

from specjax import cli
from specjax.train.drafter import DrafterTrainConfig, train_drafter

REPORT = ("method", "num_params", "steps", "tokens_seen", "wall_seconds",
          "draft_vocab_coverage", "heldout_agreement_by_depth")


@cli.usage_errors
def main(argv=None):
  return cli.train_main(__doc__.splitlines()[0], train_drafter, REPORT,
                        config_class=DrafterTrainConfig, argv=argv)


if __name__ == "__main__":
  main()
