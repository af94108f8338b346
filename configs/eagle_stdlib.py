"""EAGLE (1/2) for the embedded target: one feature-level layer, teacher forcing + regression.

  python -m experiments.train_drafter --config configs/eagle_stdlib.py

Exports to specjax/assets/eagle; decoding uses EAGLE-2's dynamic tree.
"""

from configs.drafter_common import drafter_config


def get_config():
  return drafter_config("eagle", train_steps=1, learning_rate=2e-3)
