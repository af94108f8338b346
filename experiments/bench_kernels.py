"""Pallas tree attention vs its jnp reference vs the model's XLA attention, over S and N.

  python -m experiments.bench_kernels         # S in {1k, 4k, 16k, 32k}, N in {1, 16, 64}
  python -m experiments.bench_kernels --sizes 2048 --nodes 8,32 --heads 8 --kv-heads 2 --head-dim 64

Shape defaults to a Llama-3-8B layer (H=32, K=8, D=128, bfloat16), batch 1, every cache full
(length = S - N). Prints median time and achieved KV-read bandwidth of each implementation and, on
a known GPU/TPU, the fraction of peak memory bandwidth. On CPU the kernel runs in interpret mode:
the run checks it against the reference and its timings are not meaningful; sizes above
--cpu-max-size are skipped (about a minute on 2 cores with the defaults).
"""

from __future__ import annotations

from specjax import cli, compile_cache


@cli.usage_errors
def main(argv=None):
  parser = cli.tool_parser(__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--sizes", type=cli.positive_ints, default=[1024, 4096, 16384, 32768],
                      help="S values")
  parser.add_argument("--nodes", type=cli.positive_ints, default=[1, 16, 64],
                      help="N values (tree sizes)")
  parser.add_argument("--batch", type=cli.positive_int, default=1)
  parser.add_argument("--heads", type=cli.positive_int, default=32)
  parser.add_argument("--kv-heads", type=cli.positive_int, default=8)
  parser.add_argument("--head-dim", type=cli.positive_int, default=128)
  parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
  parser.add_argument("--iters", type=cli.positive_int, default=None,
                      help="timed calls (none: 20; on a CPU 2)")
  parser.add_argument("--cpu-max-size", type=cli.positive_int, default=4096,
                      help="on CPU, skip sizes above this (interpret mode is slow)")
  args = parser.parse_args(argv)
  compile_cache.from_args(args)

  import jax

  from pallas_kernels import bench
  from specjax.models.attention import xla_attention

  device = jax.devices()[0]
  interpret = jax.default_backend() not in ("gpu", "tpu")
  print(f"device: {device.device_kind} ({jax.default_backend()})")
  if interpret:
    print("CPU: the Pallas kernel runs in interpret mode; its timings are NOT meaningful. "
          "The 'check' column compares it with the reference.")
  elif bench.peak_bandwidth(device) is None:
    print("peak memory bandwidth of this device unknown: %peak not reported")
  print(f"shape: B={args.batch} H={args.heads} K={args.kv_heads} D={args.head_dim} {args.dtype}; "
        "length = S - N (S live KV slots per row)\n")
  rows = bench.run(args.sizes, args.nodes, batch=args.batch, heads=args.heads,
                   kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                   iters=args.iters, cpu_max_size=args.cpu_max_size,
                   impls={"xla": xla_attention})
  print(bench.format_table(rows))
  if any(r.note == "MISMATCH" for r in rows):
    raise SystemExit("the kernel disagrees with the reference")
  return rows


if __name__ == "__main__":
  main()
