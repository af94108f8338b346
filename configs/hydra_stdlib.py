"""Hydra heads for the embedded target: 4 sequentially dependent heads, teacher forcing.

  python -m experiments.train_drafter --config configs/hydra_stdlib.py

Exports to runs/hydra_stdlib/export.
"""

from configs.drafter_common import drafter_config


def get_config():
  return drafter_config("hydra", train_steps=4, learning_rate=3e-3, eval_depth=4)
