"""EAGLE-3 for the embedded target: fused taps (2, 4, 6), training-time test over 4 steps.

  python -m experiments.train_drafter --config configs/eagle3_stdlib.py

Self-distilled data (the target's greedy continuations of stdlib prompts), 2048-token draft
vocabulary, own draft head initialised from the target's. Exports to runs/eagle3_stdlib/export.
1800 steps over 8192 rows, EAGLE's recipe; a step runs the layer 4 times (the unroll), so it
costs several EAGLE steps. The export's metadata.json records held-out agreement and wall time.
"""

from configs.drafter_common import drafter_config


def get_config():
  return drafter_config("eagle3", train_steps=4, learning_rate=2e-3, steps=1800,
                        distill_rows=8192)
