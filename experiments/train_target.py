"""Train a causal LM on the stdlib-code corpus and export it in Hugging Face format.

  python -m experiments.train_target --config configs/target_stdlib.py
  python -m experiments.train_target --config configs/draft_lm_stdlib.py
  python -m experiments.train_target --config configs/target_stdlib.py --set optim.total_steps=50

Interrupt it at any time: running the same command again resumes from the last checkpoint in
the config's workdir and reaches the same parameters as an uninterrupted run.
"""

from __future__ import annotations

from specjax import cli
from specjax.train.target_lm import LMTrainConfig, train_lm

REPORT = ("num_params", "steps", "tokens_seen", "wall_seconds", "heldout_loss",
          "unigram_baseline_loss")


@cli.usage_errors
def main(argv=None):
  return cli.train_main(__doc__.splitlines()[0], train_lm, REPORT,
                        default_config="configs/target_stdlib.py", config_class=LMTrainConfig,
                        argv=argv)


if __name__ == "__main__":
  main()
