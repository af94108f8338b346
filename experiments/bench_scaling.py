"""Tokens/s over device meshes and batch sizes: one method, the same prompts, several meshes.

  python -m experiments.bench_scaling                     # the embedded target, every mesh the
                                                          # devices allow, batches 1, 8, 32
  python -m experiments.bench_scaling --meshes "dp=8,tp=1;dp=2,tp=4" --batches 1,8 \\
      --method eagle3 --max-new-tokens 64 --out out/scaling.json
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.bench_scaling \\
      --max-new-tokens 16                                 # 8 emulated CPU devices

For each mesh the target is placed with `Target.on_mesh` and the drafter built on it (laid out by
its partition rules, `specjax.sharding`); for each batch size one warm-up generation compiles
(excluded), then `--repeats` timed ones. Printed per (mesh, batch): tokens/s, tau, the parameter
bytes each device holds (read from the arrays' shards), the KV-cache bytes each device holds (the
cache `generate` allocates, from its shape and `sharding.cache_spec`), and whether the tokens equal
the first mesh's (greedy: they should on every mesh). The default meshes are those of dp=N,tp=1,
dp=N/2,tp=2, dp=N/4,tp=4 and dp=1,tp=N (N devices) that the target's heads, MLP and vocabulary
divide. A batch is padded to a multiple of dp with rows that start finished; tokens/s counts the
real rows only. On CPU the emulated devices share the host's cores, so the figures only show that it
runs, not how it scales.
"""

from __future__ import annotations

import math
import os

import numpy as np

from specjax import cli, compile_cache

AR = "autoregressive"


def candidate_meshes(num_devices: int) -> list[str]:
  """dp=N,tp=1 / dp=N/2,tp=2 / dp=N/4,tp=4 / dp=1,tp=N, those N devices split into, in order."""
  out: list[str] = []
  for tp in (1, 2, 4, num_devices):
    spec = f"dp={num_devices // tp},tp={tp}"
    if num_devices % tp == 0 and spec not in out:
      out.append(spec)
  return out


def fitting_meshes(target, specs: list[str], devices) -> tuple[list, list[str]]:
  """The meshes of `specs` over `devices` that the target's parameters can be laid out on, and a
  reason for each one that cannot (e.g. heads that the model axis does not divide)."""
  from specjax import sharding
  meshes, skipped = [], []
  for spec in specs:
    try:
      mesh = sharding.make_mesh(spec, devices=devices)
      sharding.param_shardings(target.config, target.params, mesh)
    except sharding.ShardingError as e:
      skipped.append(f"{spec}: {e}")
      continue
    meshes.append(mesh)
  return meshes, skipped


def kv_cache_bytes(cfg, mesh, batch: int, length: int) -> int:
  """Bytes of the KV cache of `batch` rows (padded as `generate` pads them,
  `decoding.batch_rows`: a power of two, then a multiple of dp) that each device of
  `mesh` holds: each layer's keys and values [B, S, K, D] laid out by `sharding.cache_spec`
  (rows over data, KV heads over model or replicated) and the int32 lengths [B] over data.
  Every device holds one equal shard of each, so the figure is the same on all of them."""
  import jax
  from jax.sharding import NamedSharding

  from specjax import decoding, sharding
  from specjax.models import decoder
  rows = decoding.batch_rows(batch, mesh)
  shapes = jax.eval_shape(lambda: decoder.init_cache(cfg, rows, length))
  kv = NamedSharding(mesh, sharding.cache_spec(cfg, mesh))

  def nbytes(x, s) -> int:
    return math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
  return (sum(nbytes(x, kv) for x in shapes.k + shapes.v)
          + nbytes(shapes.length, sharding.batch_sharding(mesh)))


def load_prompts(target, dataset: str, count: int, max_prompt_tokens: int, seed: int,
                 data_dir: str | None) -> list[list[int]]:
  """`count` token-id prompts: the benchmark's (`humaneval`, `stdlib_heldout`; repeated when the
  set has fewer), or uniformly random ids of length `max_prompt_tokens` (`random`)."""
  if dataset == "random":
    rs = np.random.RandomState(seed)
    return [rs.randint(0, target.config.vocab_size, size=max_prompt_tokens).tolist()
            for _ in range(count)]
  from specjax.lab.benchmark import BenchmarkConfig
  from specjax.lab.benchmark import load_prompts as benchmark_prompts
  rows = benchmark_prompts(target, dataset, BenchmarkConfig(
      num_prompts=count, max_prompt_tokens=max_prompt_tokens, data_dir=data_dir))
  if not rows:
    raise ValueError(f"no prompts of 8 tokens or more in {dataset}")
  return [rows[i % len(rows)] for i in range(count)]


def _bytes(n: int | None) -> str:
  from specjax.lab.report import format_bytes
  return "-" if n is None else format_bytes(n)


def format_table(rows: list[dict]) -> str:
  """One Markdown row per (mesh, batch); bytes per device are the max over devices."""
  from specjax import metrics
  drafter = any(r["drafter_param_bytes"] for r in rows)
  head = ["mesh", "batch", "tokens/s", "tau", "target params/device"]
  head += ["drafter params/device"] if drafter else []
  head += ["KV cache/device", "= first mesh"]
  lines = metrics.markdown_table(head)
  for r in rows:
    cells = [r["mesh"], str(r["batch"]), f"{r['tokens_per_second']:.1f}", f"{r['tau']:.2f}",
             _bytes(r["target_param_bytes"]["max"])]
    if drafter:
      cells.append(_bytes((r["drafter_param_bytes"] or {}).get("max")))
    cells += [_bytes(r["kv_cache_bytes_per_device"]), "yes" if r["matches_first_mesh"] else "NO"]
    lines.append(metrics.markdown_row(cells))
  return "\n".join(lines)


@cli.usage_errors
def main(argv=None) -> dict:
  parser = cli.tool_parser(__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--target", default=None, help="HF-format folder (default: embedded)")
  parser.add_argument("--meshes", default=None,
                      help="';'-separated mesh specs, e.g. 'dp=8,tp=1;dp=2,tp=4' "
                      "(default: those the device count and the target allow)")
  parser.add_argument("--devices", type=cli.positive_int, default=None,
                      help="use the first N devices (default: all)")
  parser.add_argument("--batches", type=cli.positive_ints, default=[1, 8, 32])
  parser.add_argument("--method", default=AR, help="autoregressive or a drafter name")
  parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                      help="a drafter builder option, e.g. --option num_tokens=4")
  parser.add_argument("--max-new-tokens", type=cli.positive_int, default=64)
  parser.add_argument("--max-prompt-tokens", type=cli.positive_int, default=64)
  parser.add_argument("--dataset", choices=["humaneval", "stdlib_heldout", "random"],
                      default=None, help="prompts (default: humaneval with a tokenizer, "
                      "else random ids)")
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--repeats", type=cli.positive_int, default=1, help="timed calls per cell")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="parameter storage dtype")
  parser.add_argument("--seed", type=cli.seed, default=0)
  parser.add_argument("--out", default=None, help="also write the results to this JSON file")
  args = parser.parse_args(argv)
  compile_cache.from_args(args)
  if not args.batches or min(args.batches) < 1 or args.repeats < 1:
    parser.error("--batches must be positive ints and --repeats at least 1")

  import jax

  from specjax import assets, config_utils, decoding, drafters, files, provenance, sharding
  from specjax.decoding import generate
  from specjax.interop.hf import load_target
  from specjax.lab.benchmark import param_bytes

  cli.check_out_file(parser, args.out)  # before measuring
  path = args.target or assets.TARGET_DIR
  if not os.path.exists(os.path.join(path, "config.json")):
    parser.error(f"no target at {path}: pass --target DIR (an HF-format folder)")
  target = load_target(path, dtype=args.dtype)
  devices = jax.devices()[:args.devices] if args.devices else jax.devices()
  specs = ([s.strip() for s in args.meshes.split(";") if s.strip()] if args.meshes
           else candidate_meshes(len(devices)))
  meshes, skipped = fitting_meshes(target, specs, devices)
  if (args.meshes and skipped) or not meshes:
    parser.error("; ".join(skipped) or "no mesh to run on")
  options = {}
  try:
    for item in args.option:
      key, raw = config_utils.parse_assignment(item, "drafter option", "name=value")
      options[key] = config_utils.parse_value(raw)
    # Built once on one device to learn its tree size (and refuse a bad name or option early).
    drafter = None if args.method == AR else drafters.build(args.method, target, **options)
  except ValueError as e:
    parser.error(str(e))
  num_nodes = 0 if drafter is None else drafter.num_nodes
  del drafter
  dataset = args.dataset or ("humaneval" if target.tokenizer is not None else "random")
  prompts = load_prompts(target, dataset, max(args.batches), args.max_prompt_tokens, args.seed,
                         args.data_dir)
  pad_to = max(len(p) for p in prompts)  # one prompt width for every batch and mesh
  length = decoding.cache_length(pad_to, args.max_new_tokens, num_nodes,
                                 target.config.max_position_embeddings)

  platform = devices[0].platform
  print(f"devices: {len(devices)} x {platform} ({devices[0].device_kind}); target "
        f"{'embedded' if args.target is None else path} ({target.num_params / 1e6:.2f}M params, "
        f"{args.dtype}); method {args.method}; greedy, {args.max_new_tokens} new tokens, "
        f"{dataset} prompts padded to {pad_to} tokens; warm-up (compile) excluded from timing")
  if platform == "cpu":
    print("CPU: the emulated devices share the host's cores; the figures only show that it "
          "runs, not how it scales")
  for line in skipped:
    print(f"skipped {line}")

  rows: list[dict] = []
  first: dict[int, list[list[int]]] = {}
  for mesh in meshes:
    placed = target.on_mesh(mesh)
    # build lays the drafter out on the placed target's mesh by its partition rules.
    placed_drafter = None if args.method == AR else drafters.build(args.method, placed, **options)
    target_bytes = param_bytes(placed.params, mesh)
    drafter_bytes = None if placed_drafter is None else param_bytes(placed_drafter, mesh)
    for batch in args.batches:
      kwargs = dict(max_new_tokens=args.max_new_tokens, drafter=placed_drafter, seed=args.seed,
                    eos_token_id=[], pad_to=pad_to)
      warm = generate(placed, prompts[:batch], **kwargs)  # compiles: excluded
      tokens = tau_sum = wall = 0.0
      for _ in range(args.repeats):
        r = generate(placed, prompts[:batch], **kwargs)
        tokens += r.stats.new_tokens
        wall += r.stats.wall_seconds
        tau_sum += r.stats.tau
      first.setdefault(batch, r.tokens)
      rows.append({
          "mesh": sharding.mesh_spec(mesh), "mesh_description": sharding.describe(mesh),
          "batch": batch, "padded_batch": sharding.padded_batch(batch, mesh),
          "tokens_per_second": tokens / wall, "tau": tau_sum / args.repeats,
          "new_tokens": int(tokens), "wall_seconds": wall,
          "compile_seconds": warm.stats.compile_seconds,
          "target_param_bytes": target_bytes, "drafter_param_bytes": drafter_bytes,
          "cache_len": length,
          "kv_cache_bytes_per_device": kv_cache_bytes(target.config, mesh, batch, length),
          "matches_first_mesh": r.tokens == first[batch]})
      print(f"  {rows[-1]['mesh']} batch {batch}: {rows[-1]['tokens_per_second']:.1f} tokens/s",
            flush=True)
  print()
  print(format_table(rows))
  print(f"\nbytes per device: the max over devices (the KV cache: {length} slots per row); "
        f"'= first mesh': the tokens equal {rows[0]['mesh']}'s")
  results = {"platform": platform, "num_devices": len(devices),
             "target": "embedded" if args.target is None else path, "method": args.method,
             "dataset": dataset, "pad_to": pad_to, "max_new_tokens": args.max_new_tokens,
             "skipped_meshes": skipped, "rows": rows}
  if args.out:
    results["provenance"] = provenance.collect(vars(args))
    files.write_json(args.out, results, indent=1, allow_nan=False)  # atomic
    print(f"results in {args.out}")
  if not all(r["matches_first_mesh"] for r in rows):
    print("WARNING: greedy outputs differ between meshes")
  return results


if __name__ == "__main__":
  main()
