"""DFlash for the embedded target: a block of 8 (the last token and 7 masked positions) drafted
in one pass by two Qwen3 layers (8 query and 8 KV heads) over fused taps (2, 4, 6), with a
rank-32 causal correction (each depth conditioned on the token drafted one depth above).

  python -m experiments.train_drafter --config configs/dflash_stdlib.py

The shared recipe's self-distilled rows (the target's greedy continuations of stdlib prompts;
the EAGLE family's 8192 rows, so the cache is shared) and 2048-token draft vocabulary. Each step
trains 64 random anchors per row (DFlash's anchors, sorted, without replacement), every depth of
the block with DFlash's position-decayed loss, w_k = exp(-(k - 1) / gamma), gamma = 4 (the
reference's value for blocks of 8). Exports to runs/dflash_stdlib/export.
"""

import dataclasses

from configs.drafter_common import drafter_config
from specjax.drafters.dflash import DFlashOptions, gamma_decay

BLOCK = 8
GAMMA = 4.0


def get_config():
  cfg = drafter_config("dflash", train_steps=BLOCK - 1, learning_rate=2e-3, steps=1200,
                       distill_rows=8192, eval_depth=BLOCK - 1)
  options = DFlashOptions(block_size=BLOCK, num_layers=2, num_kv_heads=8, correction_rank=32,
                          num_anchors=64)
  return dataclasses.replace(cfg, family=options, step_decay=gamma_decay(GAMMA))
