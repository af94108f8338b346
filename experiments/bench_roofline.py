"""Roofline of the draft-verify loop: an oracle drafter whose every node is accepted.

  python -m experiments.bench_roofline                   # embedded target + an ~80M random one
  python -m experiments.bench_roofline --chains 1,2,4,8,16 --max-new-tokens 128
  python -m experiments.bench_roofline --targets embedded --dtype bfloat16 --compute-dtype bfloat16

For chain length N the oracle proposes the target's own greedy continuation, so each round emits
N + 1 tokens for one target call on N + 1 tokens. The best a loop can do is the bound
t_AR_step * (N + 1) / t_verify(N + 1); the measured speedup over autoregressive decoding is
printed beside it, with the loop's efficiency (measured / bound). On a CPU a small target is
compute-bound, so verifying N + 1 tokens costs well over one step and the bound is modest.

Then, per block size T = N + 1, where a verify step's time goes (`specjax.profiling`): the target
forward, the LM head's share (T - 1 more rows of logits), attending the cache's empty slots,
acceptance (greedy and sampled), the cache commit, and the loop's whole verify phase.
"""

from __future__ import annotations

import argparse

import numpy as np

import specjax
from specjax import assets, compile_cache
from specjax.benchmark import oracle_roofline
from specjax.metrics import markdown_table
from specjax.profiling import PARTS, verify_parts


def large_random_target(dtype: str, compute_dtype: str) -> specjax.Target:
  """~80M parameters: Qwen3 shape, 768 wide, 10 layers, MHA 12 heads, vocab 8192, random weights."""
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=768,
                            intermediate_size=2048, num_layers=10, num_heads=12, num_kv_heads=12,
                            head_dim=64, qk_norm=True, tie_word_embeddings=True,
                            max_position_embeddings=2048, dtype=dtype,
                            compute_dtype=compute_dtype)
  return specjax.Target.random(cfg, seed=0)


def roofline(target, name: str, chains, prompt_len: int, max_new: int, repeats: int):
  rs = np.random.RandomState(0)
  prompt = rs.randint(0, target.config.vocab_size, size=prompt_len).tolist()
  result = oracle_roofline(target, prompt, chains, max_new, repeats)
  print(f"\n### {name}: {target.num_params / 1e6:.1f}M params ({target.config.dtype}), "
        f"prompt {prompt_len}, {max_new} new tokens, batch 1, T=0\n")
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


def parts(target, name: str, sizes, prompt_len: int, max_new: int, repeats: int):
  rows = verify_parts(target, sizes, prompt_len=prompt_len, max_new=max_new, repeats=repeats)
  cfg = target.config
  print(f"\n### {name}: a verify step's parts (ms), {cfg.dtype} weights, {cfg.compute_dtype} "
        f"compute, prompt {prompt_len}, batch 1\n")
  header = ["T", "cache slots", "forward", "LM head (T-1 rows)", "empty cache slots",
            "accept T=0", "accept T=1", "commit", "verify phase", "phase / t_step"]
  for line in markdown_table(header, [
      [r["t"], r["cache_slots"], *(f"{r[k] * 1e3:.3f}" for k in PARTS), f"{r['ratio']:.2f}"]
      for r in rows]):
    print(line, flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--chains", default="1,2,4,8,16")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--targets", default="embedded,large")
  parser.add_argument("--dtype", default="float32", help="parameter dtype")
  parser.add_argument("--compute-dtype", default="float32", help="activation / cache dtype")
  parser.add_argument("--parts", default="1,2,4,8,16",
                      help="block sizes of the verify-step breakdown ('' skips it)")
  args = parser.parse_args(argv)
  compile_cache.from_args(args)
  chains = [int(c) for c in args.chains.split(",") if c]
  sizes = [int(t) for t in args.parts.split(",") if t]
  for name in args.targets.split(","):
    if name == "large":
      target = large_random_target(args.dtype, args.compute_dtype)
    else:
      target = specjax.load_target(assets.TARGET_DIR if name == "embedded" else name,
                                   dtype=args.dtype, compute_dtype=args.compute_dtype)
    if chains:
      roofline(target, name, chains, args.prompt_len, args.max_new_tokens, args.repeats)
    if sizes:
      parts(target, name, sizes, args.prompt_len, args.max_new_tokens, args.repeats)


if __name__ == "__main__":
  main()
