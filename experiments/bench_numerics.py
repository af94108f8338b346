"""Greedy identity under the checkpoint's dtype: how often speculative or batched decoding
differs from autoregressive decoding at batch 1, per method, batch size and dtype.

  python -m experiments.bench_numerics            # 200 prompts; bf16 weights, bf16 compute, f32
  python -m experiments.bench_numerics --prompts 40 --dtypes bfloat16/bfloat16 --methods eagle

The prompts are windows (24-96 tokens) of numpy's own sources, text the embedded target was not
trained or tuned on. For each dtype the reference is autoregressive decoding of each prompt alone
(batch 1); every other run (autoregressive at batch 4, each drafter at batch 1 and 4) counts the
prompts whose `max_new_tokens` greedy tokens differ from it anywhere. A dtype setting is
`storage[/compute]` (`load_target(dtype=, compute_dtype=)`): `bfloat16` is the default policy,
bfloat16 weights computed in float32; `bfloat16/bfloat16` computes in bfloat16 too; `float32`.
Beside the counts: autoregressive tokens/s at batch 1 (the policy's cost on this machine). Prints
one table per setting; `--out` writes the figures as JSON.
"""

from __future__ import annotations

import glob
import os

import numpy as np
from tqdm.auto import tqdm

import specjax
from specjax import assets, cli, compile_cache, drafters, files


def numpy_prompts(target, count: int, seed: int = 0) -> list[list[int]]:
  """`count` token windows of 24-96 tokens from numpy's .py files (chosen by `seed`)."""
  root = os.path.dirname(np.__file__)
  files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
  rng = np.random.default_rng(seed)
  prompts = []
  while len(prompts) < count:
    with open(files[rng.integers(len(files))], encoding="utf-8", errors="replace") as f:
      ids = target.encode(f.read())
    n = int(rng.integers(24, 97))
    if len(ids) > n:
      start = int(rng.integers(0, len(ids) - n))
      prompts.append(ids[start:start + n])
  return prompts


def run(target, prompts, method, batch, max_new_tokens, bar):
  """(greedy tokens per prompt, emitted tokens per second of the compiled calls)."""
  drafter = None if method == "autoregressive" else drafters.build(method, target)
  out, wall = [], 0.0
  for i in range(0, len(prompts), batch):
    rows = prompts[i:i + batch]
    res = specjax.generate(target, rows, max_new_tokens=max_new_tokens, drafter=drafter,
                           eos_token_id=[], pad_to=96)
    out += res.tokens
    wall += res.stats.wall_seconds if i else 0.0  # the first call compiles
    bar.update(len(rows))
  emitted = max_new_tokens * (len(prompts) - min(batch, len(prompts)))
  return out, emitted / wall if wall else float("nan")


@cli.usage_errors
def main(argv=None):
  parser = cli.tool_parser(__doc__.splitlines()[0])
  compile_cache.add_arguments(parser)
  parser.add_argument("--prompts", type=cli.positive_int, default=200)
  parser.add_argument("--max-new-tokens", type=cli.positive_int, default=64)
  parser.add_argument("--dtypes", default="bfloat16,bfloat16/bfloat16,float32",
                      help="comma-separated storage[/compute] dtype settings")
  parser.add_argument("--methods", default=None, help="default: every available drafter")
  parser.add_argument("--batches", type=cli.positive_ints, default=[1, 4])
  parser.add_argument("--out", default=None, help="write the figures as JSON here")
  args = parser.parse_args(argv)
  cli.check_out_file(parser, args.out)  # before measuring
  compile_cache.from_args(args)
  results = {}
  for setting in args.dtypes.split(","):
    dtype, _, compute = setting.partition("/")
    target = specjax.load_target(assets.TARGET_DIR, dtype=dtype,
                                 compute_dtype=compute or "float32")
    prompts = numpy_prompts(target, args.prompts)
    methods = args.methods.split(",") if args.methods else drafters.available(target)
    batches = args.batches
    runs = [("autoregressive", b) for b in batches if b != 1] + [
        (m, b) for m in methods for b in batches]
    with tqdm(total=len(prompts) * (len(runs) + 1), desc=f"numerics {setting}") as bar:
      reference, speed = run(target, prompts, "autoregressive", 1, args.max_new_tokens, bar)
      table = {}
      for method, batch in runs:
        got, _ = run(target, prompts, method, batch, args.max_new_tokens, bar)
        table[f"{method}@{batch}"] = sum(a != b for a, b in zip(got, reference))
    results[setting] = {"prompts": len(prompts), "differ": table,
                        "ar_tokens_per_second": speed}
    print(f"\n### {setting} (weights/compute {dtype}/{compute or 'float32'}): prompts whose "
          f"greedy output differs from autoregressive at batch 1 ({len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens; autoregressive {speed:.0f} tokens/s)\n")
    print("| run | differ | rate |\n|---|---|---|")
    for name, n in table.items():
      print(f"| {name} | {n} | {n / len(prompts):.1%} |")
  if args.out:
    from specjax import provenance
    files.write_json(args.out, {**results, "provenance": provenance.collect(vars(args))},
                     indent=1)  # atomic
  return results


if __name__ == "__main__":
  main()
