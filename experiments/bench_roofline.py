"""Roofline of the draft-verify loop: an oracle drafter whose every node is accepted.

  python -m experiments.bench_roofline                   # embedded target + an ~80M random one
  python -m experiments.bench_roofline --chains 1,2,4,8,16 --max-new-tokens 128

For chain length N the oracle proposes the target's own greedy continuation, so each round emits
N + 1 tokens for one target call on N + 1 tokens. The best a loop can do is the bound
t_AR_step * (N + 1) / t_verify(N + 1); the measured speedup over autoregressive decoding is
printed beside it, with the loop's efficiency (measured / bound). On a CPU a small target is
compute-bound, so verifying N + 1 tokens costs well over one step and the bound is modest.
"""

from __future__ import annotations

import argparse

import numpy as np

import specjax
from specjax import assets, compile_cache
from specjax.benchmark import oracle_roofline


def large_random_target() -> specjax.Target:
  """~80M parameters: Qwen3 shape, 768 wide, 10 layers, MHA 12 heads, vocab 8192, random weights."""
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=768,
                            intermediate_size=2048, num_layers=10, num_heads=12, num_kv_heads=12,
                            head_dim=64, qk_norm=True, tie_word_embeddings=True,
                            max_position_embeddings=2048)
  return specjax.Target.random(cfg, seed=0)


def roofline(target, name: str, chains, prompt_len: int, max_new: int, repeats: int):
  rs = np.random.RandomState(0)
  prompt = rs.randint(0, target.config.vocab_size, size=prompt_len).tolist()
  result = oracle_roofline(target, prompt, chains, max_new, repeats)
  print(f"\n### {name}: {target.num_params / 1e6:.1f}M params, prompt {prompt_len}, "
        f"{max_new} new tokens, batch 1, T=0\n")
  print(f"autoregressive: {result['tokens_per_second']:.1f} tokens/s, step "
        f"{result['t_step_ms']:.2f} ms, prefill {result['t_prefill_ms']:.2f} ms\n")
  print("| N | tau | t_verify(N+1) / t_step | bound (N+1) | bound (tau) | bound (tau, prefill) | "
        "measured speedup | efficiency |")
  print("|---|---|---|---|---|---|---|---|")
  for r in result["rows"]:
    print(f"| {r['n']} | {r['tau']:.2f} | {r['cost']:.2f} | {r['bound']:.2f}x | "
          f"{r['bound_tau']:.2f}x | {r['bound_e2e']:.2f}x | {r['speedup']:.2f}x | "
          f"{r['speedup'] / r['bound_e2e']:.0%} |", flush=True)
  return result["rows"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--chains", default="1,2,4,8,16")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--targets", default="embedded,large")
  args = parser.parse_args(argv)
  compile_cache.from_args(args)
  chains = [int(c) for c in args.chains.split(",")]
  for which in args.targets.split(","):
    if which == "embedded":
      target = specjax.load_target(assets.TARGET_DIR, dtype="float32")
    elif which == "large":
      target = large_random_target()
    else:
      target = specjax.load_target(which, dtype="float32")
    roofline(target, which, chains, args.prompt_len, args.max_new_tokens, args.repeats)


if __name__ == "__main__":
  main()
