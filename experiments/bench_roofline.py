"""Roofline of the draft-verify loop: an oracle drafter whose every node is accepted.

  python -m experiments.bench_roofline                   # embedded target + an ~80M random one
  python -m experiments.bench_roofline --chains 1,2,4,8,16 --max-new-tokens 128
  python -m experiments.bench_roofline --targets embedded --dtype bfloat16 --compute-dtype bfloat16
  python -m experiments.bench_roofline --targets embedded --mesh auto   # over every core

For chain length N the oracle proposes the target's own greedy continuation, so each round emits
N + 1 tokens for one target call on N + 1 tokens. The best a loop can do is the bound
t_AR_step * (N + 1) / t_verify(N + 1); the measured speedup over autoregressive decoding is
printed beside it, with the loop's efficiency (measured / bound). On a CPU a small target is
compute-bound, so verifying N + 1 tokens costs well over one step and the bound is modest.
Beside the autoregressive step, its weight-streaming floor: the weights each device reads per
step over the rate the devices stream weights at together: the least a step on this mesh
can take.

Then, per block size T = N + 1, where a verify step's time goes (`specjax.lab.profiling`): the
target forward, the LM head's share (T - 1 more rows of logits), attending the cache's empty slots,
acceptance (greedy and sampled), the cache commit, and the loop's whole verify phase.

Last, the kernels of one decode round, from JAX's profiler (`specjax.lab.profiling.kernel_times`):
per phase and part (verify/attention, verify/mlp, draft/..., with their norms and residual
adds), how many kernels it launches and their time, for autoregressive decoding, an oracle
chain of N (`chainN`) and any drafter available for the target (`--kernels`).
"""

from __future__ import annotations

import numpy as np

import specjax
from specjax import assets, cli, compile_cache, drafters, sharding
from specjax.lab.benchmark import oracle_roofline
from specjax.lab.profiling import (
  PARTS,
  kernel_times,
  random_chain,
  step_read_bytes,
  stream_bandwidth,
  verify_parts,
)
from specjax.metrics import markdown_table


def large_random_target(dtype: str, compute_dtype: str) -> specjax.Target:
  """~80M parameters: Qwen3 shape, 768 wide, 10 layers, MHA 12 heads, vocab 8192, random weights."""
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=768,
                            intermediate_size=2048, num_layers=10, num_heads=12, num_kv_heads=12,
                            head_dim=64, qk_norm=True, tie_word_embeddings=True,
                            max_position_embeddings=2048, dtype=dtype,
                            compute_dtype=compute_dtype)
  return specjax.Target.random(cfg, seed=0)


def random_prompt(target, prompt_len: int) -> list[int]:
  """The benchmark's prompt: `prompt_len` random ids (the costs do not depend on the text)."""
  return np.random.RandomState(0).randint(0, target.config.vocab_size, size=prompt_len).tolist()


def roofline(target, name: str, chains, prompt_len: int, max_new: int, repeats: int):
  result = oracle_roofline(target, random_prompt(target, prompt_len), chains, max_new, repeats)
  print(f"\n### {name}: {target.num_params / 1e6:.1f}M params ({target.config.dtype}), "
        f"prompt {prompt_len}, {max_new} new tokens, batch 1, T=0\n")
  print(f"autoregressive: {result.tokens_per_second:.1f} tokens/s, step "
        f"{result.t_step_ms:.2f} ms, prefill {result.t_prefill_ms:.2f} ms")
  floor = weight_floor(target)
  print(f"weight-streaming floor: {floor['bytes'] / 1e6:.2f} MB of weights read per step on each "
        f"device, streamed at {floor['bandwidth'] / 1e9:.1f} GB/s each (all devices at once): "
        f"{floor['seconds'] * 1e3:.2f} ms, {floor['seconds'] * 1e3 / result.t_step_ms:.0%} "
        f"of the measured step\n")
  print("| N | tau | t_verify(N+1) / t_step | bound (N+1) | bound (tau) | bound (tau, prefill) | "
        "measured speedup | efficiency |")
  print("|---|---|---|---|---|---|---|---|")
  for r in result.rows:
    print(f"| {r.n} | {r.tau:.2f} | {r.cost:.2f} | {r.bound:.2f}x | {r.bound_tau:.2f}x | "
          f"{r.bound_e2e:.2f}x | {r.speedup:.2f}x | {r.speedup / r.bound_e2e:.0%} |", flush=True)
  return result.rows


def weight_floor(target) -> dict[str, float]:
  """The least time a batch-1 step can take on this machine: the weights each device reads per
  step (`profiling.step_read_bytes`) over the rate each streams them at with every device of the
  target's mesh streaming at once (`profiling.stream_bandwidth`)."""
  nbytes = step_read_bytes(target)
  bandwidth = stream_bandwidth(target.mesh)
  return {"bytes": nbytes, "bandwidth": bandwidth, "seconds": nbytes / bandwidth}


def parts(target, name: str, sizes, prompt_len: int, max_new: int, repeats: int):
  rows = verify_parts(target, sizes, prompt_len=prompt_len, max_new=max_new, repeats=repeats)
  cfg = target.config
  print(f"\n### {name}: a verify step's parts (ms), {cfg.dtype} weights, {cfg.compute_dtype} "
        f"compute, prompt {prompt_len}, batch 1\n")
  header = ["T", "cache slots", "forward", "LM head (T-1 rows)", "empty cache slots",
            "accept T=0", "accept T=1", "commit (chain)", "commit (tree)", "verify phase",
            "phase / t_step"]
  for line in markdown_table(header, [
      [r["t"], r["cache_slots"], *(f"{r[k] * 1e3:.3f}" for k in PARTS), f"{r['ratio']:.2f}"]
      for r in rows]):
    print(line, flush=True)
  return rows


def kernel_drafter(target, spec: str, prompt_len: int, max_new: int):
  """The drafter a `--kernels` entry names: None (autoregressive), an oracle chain of N for
  'chainN' (its tokens random: a round's kernels do not depend on what it accepts), else the
  registered drafter; ValueError for one the target has no drafter of."""
  if spec == "autoregressive":
    return None
  if spec.startswith("chain") and spec[5:].isdigit():
    return random_chain(target, int(spec[5:]), prompt_len, max_new, np.random.RandomState(1))
  if spec not in drafters.available(target):
    raise ValueError(f"{spec!r} is not available for this target (available: autoregressive, "
                     f"chainN, {', '.join(drafters.available(target)) or 'no drafter'})")
  return drafters.build(spec, target)


def kernels(target, name: str, specs, prompt_len: int, max_new: int):
  prompt = random_prompt(target, prompt_len)
  columns = {}
  for spec in specs:
    try:
      drafter = kernel_drafter(target, spec, prompt_len, max_new)
    except ValueError as e:
      print(f"\n{spec}: skipped, {e}")
      continue
    columns[spec] = kernel_times(target, [prompt], drafter=drafter, max_new_tokens=max_new)
  if not columns:
    return columns
  scopes = sorted({s for c in columns.values() for s in c if s != "total"},
                  key=lambda s: -max(c.get(s, {}).get("seconds", 0.0) for c in columns.values()))
  print(f"\n### {name}: kernels per decode round (count, ms of their summed medians), "
        f"prompt {prompt_len}, batch 1\n")
  header = ["phase/part"] + [f"{spec} {what}" for spec in columns for what in ("kernels", "ms")]
  rows = [[scope] + [cell for c in columns.values() for cell in (
      (f"{c[scope]['kernels']:.0f}", f"{c[scope]['seconds'] * 1e3:.3f}") if scope in c
      else ("-", "-"))] for scope in scopes + ["total"]]
  for line in markdown_table(header, rows):
    print(line, flush=True)
  return columns


@cli.usage_errors
def main(argv=None):
  parser = cli.tool_parser(__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--chains", default="1,2,4,8,16")
  parser.add_argument("--prompt-len", type=cli.positive_int, default=128)
  parser.add_argument("--max-new-tokens", type=cli.positive_int, default=128)
  parser.add_argument("--repeats", type=cli.positive_int, default=10)
  parser.add_argument("--targets", default="embedded,large")
  parser.add_argument("--dtype", default="float32", help="parameter dtype")
  parser.add_argument("--compute-dtype", default="float32", help="activation / cache dtype")
  parser.add_argument("--parts", default="1,2,4,8,16",
                      help="block sizes of the verify-step breakdown ('' skips it)")
  parser.add_argument("--kernels", default="autoregressive,chain8,eagle",
                      help="rounds whose kernels to profile: autoregressive, chainN (an oracle "
                      "chain of N) or a drafter available for the target ('' skips it)")
  cli.add_mesh_argument(parser, default=None, help_default="one device")
  args = parser.parse_args(argv)
  mesh = cli.mesh_from_args(args)
  chains = [int(c) for c in args.chains.split(",") if c]
  sizes = [int(t) for t in args.parts.split(",") if t]
  kernel_specs = [k for k in args.kernels.split(",") if k]
  for name in args.targets.split(","):
    if name == "large":
      target = large_random_target(args.dtype, args.compute_dtype)
    else:
      target = specjax.load_target(assets.TARGET_DIR if name == "embedded" else name,
                                   dtype=args.dtype, compute_dtype=args.compute_dtype)
    if mesh is not None:
      target = target.on_mesh(mesh)
      name += f" on {sharding.describe(target.mesh)}"
    if chains:
      roofline(target, name, chains, args.prompt_len, args.max_new_tokens, args.repeats)
    if sizes:
      parts(target, name, sizes, args.prompt_len, args.max_new_tokens, args.repeats)
    if kernel_specs:
      kernels(target, name, kernel_specs, args.prompt_len, args.max_new_tokens)


if __name__ == "__main__":
  main()
