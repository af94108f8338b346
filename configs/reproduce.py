"""The tables of `python -m experiments.reproduce` on the embedded default.

  python -m experiments.reproduce all
  python -m experiments.reproduce methods --set num_prompts=16 --set max_new_tokens=128

Sizes are chosen so that `all` fits in about half an hour on 2 CPU cores (compilation, one
program per method, tree and batch size, takes much of it); every field can be overridden.
"""

from specjax.lab.reproduce import ReproduceConfig


def get_config() -> ReproduceConfig:
  return ReproduceConfig(
      target=None,  # None = the shipped embedded target
      methods=(),  # () = autoregressive + every drafter available for the target
      datasets=("humaneval", "stdlib_heldout", "stdlib_docstrings"),
      num_prompts=4,
      max_prompt_tokens=256,
      max_new_tokens=64,
      seed=0,
      profile_repeats=20,
      temperatures=(0.0, 1.0),
      timing_repeats=3,
      theory_methods=("draft_lm", "eagle"),
      theory_lengths=(1, 2, 3, 4, 5, 6, 7, 8),
      budget_methods=("eagle", "dflash"),
      budget_nodes=(1, 2, 4, 8, 16, 32, 64),
      batch_methods=("prompt_lookup", "draft_lm", "eagle"),
      batch_sizes=(1, 4, 16),
      batch_prompts=16,
      out="out/reproduce",
      mesh="auto")  # the target over every core, as torch's threads in the peers table
