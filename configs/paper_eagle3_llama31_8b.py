"""EAGLE-3 on Llama-3.1-8B-Instruct: the authors' published head beside the model-free methods.

Download the two checkpoints once (any tool that writes Hugging Face folders), then run:

  huggingface-cli download meta-llama/Llama-3.1-8B-Instruct --local-dir checkpoints/llama31_8b
  huggingface-cli download yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --local-dir checkpoints/eagle3_head
  python -m experiments.benchmark --config configs/paper_eagle3_llama31_8b.py
  python -m experiments.benchmark --config configs/paper_eagle3_llama31_8b.py \\
      --set target=/data/Llama-3.1-8B-Instruct --set drafter.eagle3=/data/EAGLE3-head \\
      --set prompts=question.jsonl            # e.g. Spec-Bench's or MT-bench's questions

The head is read in its published layout (taps: EAGLE's default capture, the inputs of layers
2, 16 and 29; d2t offsets into the 128256-token vocabulary). Prompts are rendered with the
model's chat template, as the paper's evaluation does; its tree is the authors' default
(top-k 10, depth 7, 60 tokens with the root). Parameters in bfloat16 (16 GB of host memory).
"""

from specjax.lab.benchmark import BenchmarkConfig

TARGET_HUB = "meta-llama/Llama-3.1-8B-Instruct"
DRAFTER_HUB = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


def get_config() -> BenchmarkConfig:
  return BenchmarkConfig(
      target="checkpoints/llama31_8b",
      dtype="bfloat16",
      drafter={"eagle3": "checkpoints/eagle3_head"},
      methods=("autoregressive", "prompt_lookup", "eagle3"),
      drafter_options=("eagle3.depth=7", "eagle3.top_k=10", "eagle3.total_tokens=59"),
      datasets=("humaneval",),
      chat_template=True,
      num_prompts=80, max_prompt_tokens=2048, max_new_tokens=512,
      temperature=0.0, out="out/paper_eagle3_llama31_8b")
