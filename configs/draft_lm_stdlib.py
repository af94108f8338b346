"""The small draft LM for classic speculative sampling against the embedded target.

  python -m experiments.train_target --config configs/draft_lm_stdlib.py

Same tokenizer as the target (read from the target's training run, or from the shipped target),
Qwen3 architecture at about a tenth of the target's parameters (most of them the 8192 x 64
embedding), 400 steps x 8192 tokens with the same curriculum as the target: at this size the
softmax over the vocabulary, not the model, dominates the cost of a step. Exports to
runs/draft_lm_stdlib/export (the shipped one: `--set export_dir=specjax/assets/draft_lm
--overwrite-shipped`); its
metadata.json records the held-out loss and the wall time.
"""

import os

from configs.target_stdlib import get_config as target_config
from specjax import assets
from specjax.models.config import ModelConfig
from specjax.train.optim import OptimConfig
from specjax.train.target_lm import DataConfig


def _target_tokenizer() -> str:
  run = os.path.join(target_config().workdir, "tokenizer.json")
  return run if os.path.exists(run) else os.path.join(assets.TARGET_DIR, "tokenizer.json")


def get_config():
  target = target_config()
  return target.__class__(
      model=ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=64,
                        intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                        head_dim=16, qk_norm=True, tie_word_embeddings=True,
                        max_position_embeddings=2048),
      optim=OptimConfig(learning_rate=5e-3, warmup_steps=40, total_steps=400,
                        final_lr_ratio=0.1, weight_decay=0.1, clip_norm=1.0),
      data=DataConfig(tokenizer_path=_target_tokenizer()),
      seq_len=256, batch_size=32, long_steps=50, long_seq_len=1024, seed=0,
      log_every=10, eval_every=250, save_every=50,
      workdir="runs/draft_lm_stdlib", export_dtype="float32")
