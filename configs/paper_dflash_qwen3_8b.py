"""DFlash on Qwen3-8B: the authors' published block-16 drafter, its chain and a DDTree-style tree.

Download the two checkpoints once (any tool that writes Hugging Face folders), then run:

  huggingface-cli download Qwen/Qwen3-8B --local-dir checkpoints/qwen3_8b
  huggingface-cli download z-lab/Qwen3-8B-DFlash-b16 --local-dir checkpoints/dflash_qwen3_8b
  python -m experiments.benchmark --config configs/paper_dflash_qwen3_8b.py
  python -m experiments.benchmark --config configs/paper_dflash_qwen3_8b.py \\
      --set target=/data/Qwen3-8B --set drafter.dflash=/data/Qwen3-8B-DFlash-b16 \\
      --set prompts=math500.jsonl

The drafter is read in its published layout (`dflash_config.target_layer_ids` counted as layer
outputs, its `mask_token_id` a row of the target's embedding, block of 16: depths 1-15). It was
trained with thinking disabled, so the chat template runs with `enable_thinking=false`. Rows:
DFlash's own chain over the whole block (`dflash`) and a best-first tree of 32 nodes from the
same block's marginals (`dflash_tree`, the same folder). Parameters in bfloat16.
"""

from specjax.lab.benchmark import BenchmarkConfig

TARGET_HUB = "Qwen/Qwen3-8B"
DRAFTER_HUB = "z-lab/Qwen3-8B-DFlash-b16"
DRAFTER = "checkpoints/dflash_qwen3_8b"


def get_config() -> BenchmarkConfig:
  return BenchmarkConfig(
      target="checkpoints/qwen3_8b",
      dtype="bfloat16",
      drafter={"dflash": DRAFTER, "dflash_tree": DRAFTER},
      methods=("autoregressive", "prompt_lookup", "dflash", "dflash_tree"),
      drafter_options=("dflash.depth=15", "dflash_tree.depth=15", "dflash_tree.top_k=4",
                       "dflash_tree.total_tokens=32"),
      datasets=("humaneval",),
      chat_template=True, chat_options={"enable_thinking": False},
      num_prompts=80, max_prompt_tokens=2048, max_new_tokens=512,
      temperature=0.0, out="out/paper_dflash_qwen3_8b")
