"""Medusa-1 heads for the embedded target: 4 residual heads, soft targets, decay 0.8 per head.

  python -m experiments.train_drafter --config configs/medusa_stdlib.py

Exports to runs/medusa_stdlib/export.
"""

from configs.drafter_common import drafter_config


def get_config():
  return drafter_config("medusa", train_steps=4, learning_rate=3e-3, eval_depth=4)
