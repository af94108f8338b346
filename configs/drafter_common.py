"""The recipe the four shipped drafters share (one place, so they are trained alike).

Each exports to its workdir, runs/<method>_stdlib/export: a smoke run never replaces a shipped
drafter. The shipped folders were made with `--set export_dir=specjax/assets/<method>
--overwrite-shipped` (without the flag an export_dir inside specjax/assets is refused before
training).
"""

from specjax.train.drafter import DrafterTrainConfig
from specjax.train.optim import OptimConfig

STEPS = 600  # Medusa and Hydra; the EAGLE family trains longer on twice the rows (its configs)
ROWS = 4096  # self-distilled rows of 64 prompt + 192 generated tokens


def drafter_config(method: str, *, train_steps: int, learning_rate: float,
                   steps: int = STEPS, distill_rows: int = ROWS,
                   eval_depth: int = 5) -> DrafterTrainConfig:
  return DrafterTrainConfig(
      method=method,
      optim=OptimConfig(learning_rate=learning_rate, warmup_steps=30, total_steps=steps,
                        final_lr_ratio=0.1, weight_decay=0.0, clip_norm=0.5),
      source="self_distill", distill_rows=distill_rows, distill_prompt_tokens=64,
      distill_new_tokens=192, distill_temperature=0.0, distill_batch=128,
      draft_vocab_size=2048, train_steps=train_steps, step_decay=0.8,
      eval_depth=eval_depth,
      seq_len=256, batch_size=16, seed=0, log_every=10, eval_every=200, save_every=50,
      eval_rows=64, workdir=f"runs/{method}_stdlib", export_dtype="bfloat16")
