"""The main job: every available method on the embedded default (Spec-Bench methodology).

  python -m experiments.benchmark
  python -m experiments.benchmark --set temperature=0.7 --set top_p=0.9 --out out/sampled
  python -m experiments.benchmark --set methods=autoregressive,prompt_lookup --set num_prompts=4
  python -m experiments.benchmark --set mesh=dp=2,tp=4      # on a device mesh (8 devices)
  python -m experiments.benchmark --set mesh=none           # on one device (one CPU core)
  python -m experiments.benchmark --set profile=false       # no phase timings: quicker

Expected: a Markdown table (method, tau, tokens/s, speedup, target calls, share of time in
drafting, ideal speedup) per dataset, results.json / results.md / PNG plots in `out`. The
figures and the run time of the last full run are in the README's benchmark table.
"""

from specjax.lab.benchmark import BenchmarkConfig


def get_config() -> BenchmarkConfig:
  return BenchmarkConfig(
      target=None,  # None = the shipped embedded target
      methods=(),  # () = autoregressive + every drafter available for the target
      datasets=("humaneval", "stdlib_heldout"),
      num_prompts=16,
      max_prompt_tokens=256,
      max_new_tokens=128,
      temperature=0.0, top_k=0, top_p=1.0, seed=0,
      profile=True,  # phase timings: draft / verify / prefill ms and the figures built on them
      profile_repeats=10,
      out="out/benchmark",
      # "auto": the target split over every core (CPU) or device it divides into, dp=1 (on a
      # 2-core CPU: tp=2); None = one device; "dp=2,tp=4": that mesh. On a mesh the table also
      # gives the parameter bytes per device.
      mesh="auto")
