"""The embedded target: a Qwen3-architecture code LM trained on the CPython standard library.

  python -m experiments.train_target --config configs/target_stdlib.py

GQA 8/2 heads, q/k-norm, tied embeddings, context 2048; 1300 steps x 8192 tokens: 1150 steps
of 32 x 256-token rows, then 150 steps of 8 x 1024-token rows so the model learns its long
context. Resumes from its last checkpoint when interrupted; exports (bfloat16 weights) to
runs/target_stdlib/export, whose metadata.json records the held-out loss beside the unigram
baseline and the wall time. The shipped target was made with `--set
export_dir=specjax/assets/target --overwrite-shipped` (without the flag such an export_dir is
refused before training): every shipped drafter was trained against it, so replacing it (a smoke
run's 2-layer target, say) breaks them.
"""

from specjax.models.config import ModelConfig
from specjax.train.optim import OptimConfig
from specjax.train.target_lm import LMTrainConfig


def model_config() -> ModelConfig:
  return ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=256,
                     intermediate_size=768, num_layers=6, num_heads=8, num_kv_heads=2,
                     head_dim=32, qk_norm=True, tie_word_embeddings=True,
                     max_position_embeddings=2048, rope_theta=10000.0)


def get_config() -> LMTrainConfig:
  return LMTrainConfig(
      model=model_config(),
      optim=OptimConfig(learning_rate=3e-3, warmup_steps=100, total_steps=1300,
                        final_lr_ratio=0.1, weight_decay=0.1, clip_norm=1.0),
      seq_len=256, batch_size=32, long_steps=150, long_seq_len=1024, seed=0,
      log_every=10, eval_every=250, save_every=50,
      workdir="runs/target_stdlib", export_dtype="bfloat16")
