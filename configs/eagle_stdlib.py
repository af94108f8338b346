"""EAGLE (1/2) for the embedded target: one feature-level layer, teacher forcing + regression.

  python -m experiments.train_drafter --config configs/eagle_stdlib.py

Exports to runs/eagle_stdlib/export; decoding uses EAGLE-2's dynamic tree. 3600 steps over 32768
self-distilled rows, since held-out agreement kept rising with the budget (README, "The shipped
drafters"). The rows are generated once and cached in runs/self_distill, shared with other runs;
the export's metadata.json records held-out agreement and the wall time of data and training.
"""

from configs.drafter_common import drafter_config


def get_config():
  return drafter_config("eagle", train_steps=1, learning_rate=2e-3, steps=3600,
                        distill_rows=32768)
