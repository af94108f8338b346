"""Autoregressive decoding speed: specjax vs transformers, same checkpoint, same prompts, one run.

  python -m experiments.bench_ar                       # the embedded target (or a random Qwen3
                                                       # of the same shape if none is shipped)
  python -m experiments.bench_ar --checkpoint DIR --max-new-tokens 128 --prompts 8
  python -m experiments.bench_ar --mesh none           # specjax on one device (one core)

Both run greedy, batch 1, on the CPU, with a warm-up call first (compile / first-call overhead
excluded): torch on its default threads (one per core), specjax over every core (`--mesh auto`,
the target split into one CPU device per core). Prints tokens/s of each and their ratio.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from specjax import cli, compile_cache, sharding


def _default_checkpoint(tmp: str) -> str:
  from specjax import assets
  if os.path.exists(os.path.join(assets.TARGET_DIR, "config.json")):
    return assets.TARGET_DIR
  import specjax
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=256,
                            intermediate_size=768, num_layers=6, num_heads=8, num_kv_heads=2,
                            head_dim=32, qk_norm=True, tie_word_embeddings=True,
                            max_position_embeddings=2048)
  print("no shipped target found: benchmarking a random Qwen3 of the embedded default's shape")
  specjax.save_hf(specjax.Target.random(cfg), tmp)
  return tmp


@cli.usage_errors
def main(argv=None) -> dict:
  parser = cli.tool_parser(__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--checkpoint", default=None, help="HF-format folder (default: embedded)")
  parser.add_argument("--prompts", type=cli.positive_int, default=8)
  parser.add_argument("--prompt-len", type=cli.positive_int, default=64)
  parser.add_argument("--max-new-tokens", type=cli.positive_int, default=128)
  parser.add_argument("--seed", type=cli.seed, default=0)
  cli.add_mesh_argument(parser)
  args = parser.parse_args(argv)
  mesh = cli.mesh_from_args(args)

  import torch
  import transformers

  import specjax

  with tempfile.TemporaryDirectory() as tmp:
    path = args.checkpoint or _default_checkpoint(tmp)
    target = specjax.load_target(path, dtype="float32", mesh=mesh)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  rs = np.random.RandomState(args.seed)
  prompts = [rs.randint(0, target.config.vocab_size, size=args.prompt_len).tolist()
             for _ in range(args.prompts)]
  n = args.max_new_tokens

  specjax.generate(target, prompts[:1], max_new_tokens=n, eos_token_id=[])  # compile
  sj_time, sj_tokens = 0.0, 0
  for p in prompts:
    r = specjax.generate(target, [p], max_new_tokens=n, eos_token_id=[])
    sj_time += r.stats.wall_seconds
    sj_tokens += r.stats.new_tokens

  def hf_generate(p):
    with torch.no_grad():
      return hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)

  hf_generate(prompts[0])  # warm-up
  hf_time, hf_tokens = 0.0, 0
  for p in prompts:
    start = time.perf_counter()
    out = hf_generate(p)
    hf_time += time.perf_counter() - start
    hf_tokens += out.shape[1] - len(p)

  results = {
      "checkpoint": path if args.checkpoint else "embedded",
      "params": target.num_params,
      "specjax_devices": sharding.describe(target.mesh),
      "specjax_tokens_per_second": sj_tokens / sj_time,
      "transformers_tokens_per_second": hf_tokens / hf_time,
  }
  results["ratio"] = (results["specjax_tokens_per_second"]
                      / results["transformers_tokens_per_second"])
  print(f"\n| implementation | tokens/s |\n|---|---|\n"
        f"| specjax (jit, while_loop) | {results['specjax_tokens_per_second']:.1f} |\n"
        f"| transformers generate (torch {torch.__version__}) | "
        f"{results['transformers_tokens_per_second']:.1f} |\n\n"
        f"ratio specjax / transformers: {results['ratio']:.2f}x  "
        f"({target.num_params / 1e6:.2f}M params, batch 1, greedy, {args.prompts} prompts x "
        f"{n} new tokens, CPU threads: torch {torch.get_num_threads()}, specjax on "
        f"{results['specjax_devices']})")
  return results


if __name__ == "__main__":
  main()
