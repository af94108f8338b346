"""The tables of `python -m experiments.reproduce` on the embedded default.

  python -m experiments.reproduce all
  python -m experiments.reproduce methods --set num_prompts=16 --set max_new_tokens=128
  python -m experiments.reproduce budget --set budget_table.nodes=1,4,16

Sizes are chosen so that `all` fits in about half an hour on 2 CPU cores (compilation, one
program per method, tree and batch size, takes much of it); every field can be overridden.
"""

from specjax.lab.reproduce import ReproduceConfig
from specjax.lab.tables.batch import BatchTable
from specjax.lab.tables.budget import BudgetTable
from specjax.lab.tables.methods import MethodsTable
from specjax.lab.tables.sampling import SamplingTable
from specjax.lab.tables.theory import TheoryTable


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
      # T = 0, T = 0.7 with top-p 0.9 (chat sampling), T = 1: a row group each.
      methods_table=MethodsTable(temperatures=(0.0, 0.7, 1.0), top_p=(1.0, 0.9, 1.0),
                                 timing_repeats=3),
      # Every learned drafter at T = 1: top-k, i.i.d. and without-replacement children under
      # recursive rejection, k-sequential selection and (lossy) typical acceptance.
      sampling_table=SamplingTable(temperature=1.0, children=("top_k", "iid", "wor"),
                                   rules=("recursive", "kseq", "typical"), timing_repeats=3),
      theory_table=TheoryTable(methods=("draft_lm", "eagle"), lengths=(1, 2, 3, 4, 5, 6, 7, 8)),
      budget_table=BudgetTable(methods=("eagle", "dflash"), nodes=(1, 2, 4, 8, 16, 32, 64)),
      batch_table=BatchTable(methods=("prompt_lookup", "draft_lm", "eagle"), sizes=(1, 4, 16),
                             num_prompts=16),
      out="out/reproduce",
      mesh="auto")  # the target over every core, as torch's threads in the peers table
