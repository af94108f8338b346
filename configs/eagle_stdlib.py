"""EAGLE (1/2) for the embedded target: one feature-level layer, teacher forcing + regression.

  python -m experiments.train_drafter --config configs/eagle_stdlib.py

Exports to specjax/assets/eagle; decoding uses EAGLE-2's dynamic tree. 1800 steps over 8192
self-distilled rows: held-out agreement was still rising at 600 steps (depth 1: .53 at 600, .59 at
1000, .63 at 1800). Runtime: about 21 minutes on 2 CPU cores (metadata.json has the figure).
"""

from configs.drafter_common import drafter_config


def get_config():
  return drafter_config("eagle", train_steps=1, learning_rate=2e-3, steps=1800,
                        distill_rows=8192)
