"""The main job's config (`BenchmarkConfig`), which the reproduce job extends, and how it names
its datasets.

Its own module, below everything that reads it (the benchmark's runs, the writers of its
results, the reproduce tables), so that none of them has to import the others for it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated, Any, Literal

from specjax import config_utils
from specjax.config_utils import (
  Interval,
  NonEmpty,
  NonEmptyStr,
  NonNegFloat,
  NonNegInt,
  PosInt,
  Seed,
  config,
)
from specjax.sampling import SamplingConfig
from specjax.sharding import AUTO as AUTO_MESH
from specjax.sharding import check_mesh_spec

DATASETS = ("humaneval", "stdlib_heldout", "stdlib_docstrings")
DTYPES = Literal["float32", "bfloat16", "float16"]


@config
class BenchmarkConfig:
  target: NonEmptyStr | None = None  # HF folder; None = the shipped embedded target
  dtype: DTYPES = "float32"  # the target's parameters ("bfloat16": half the memory of float32)
  methods: tuple[NonEmptyStr, ...] = ()  # () = AR + drafters.available(target) + `drafter`
  # Drafter folders by method name, e.g. --set drafter.eagle3=PATH: any folder load_drafter
  # reads (specjax's own, or a published EAGLE-3 / EAGLE / Medusa / DFlash checkpoint), an HF
  # folder for draft_lm. A name that is no registered method labels a learned drafter's row.
  drafter: dict[str, NonEmptyStr] = dataclasses.field(default_factory=dict)
  # Datasets: "humaneval", "stdlib_heldout", "stdlib_docstrings" (docstring-to-code from held-out
  # stdlib functions) or a JSONL prompt file (specjax.data.prompts).
  datasets: Annotated[tuple[NonEmptyStr, ...], NonEmpty] = ("humaneval", "stdlib_heldout")
  prompts: NonEmptyStr | None = None  # a JSONL prompt file; when set, the run's only dataset
  chat_template: bool = False  # render prompts with the target's chat template
  # The template's own switches, e.g. --set chat_options.enable_thinking=false (Qwen3).
  chat_options: dict[str, bool] = dataclasses.field(default_factory=dict)
  num_prompts: PosInt = 8  # per dataset (fewer when a dataset has fewer: the tables say so)
  max_prompt_tokens: PosInt = 256  # a longer prompt keeps its last this many tokens
  max_new_tokens: PosInt = 128
  temperature: NonNegFloat = 0.0
  top_k: NonNegInt = 0
  top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
  seed: Seed = 0
  # How drafts are accepted at T > 0 (`specjax.verify.Rule`): "recursive" (recursive rejection,
  # lossless for any drafter), "kseq" (SpecTr's k-sequential selection, lossless, for drafters
  # with children=iid: --set drafter_options=eagle.children=iid) or "typical" (Medusa's typical
  # acceptance: LOSSY, marked so in every table and in results.json). T = 0 matches greedily.
  rule: Literal["recursive", "kseq", "typical"] = "recursive"
  # Phase timings (draft, verify and prefill ms, and the drafting share, ideal speedups and loop
  # efficiency built on them): one more compiled program per method. false leaves them out, for
  # a quicker table of tau, tokens/s and speedup.
  profile: bool = True
  profile_repeats: PosInt = 10
  out: NonEmptyStr = "out/benchmark"
  data_dir: NonEmptyStr | None = None
  # Per-method builder options as "method.option=value", e.g. "prompt_lookup.num_tokens=4".
  drafter_options: tuple[str, ...] = ()
  # A device mesh such as "dp=2,tp=4" (`specjax.sharding.make_mesh`); None = one device;
  # "auto" = tensor parallelism over every core or device the target allows (`auto_mesh`).
  mesh: NonEmptyStr | None = None

  def __post_init__(self):
    if self.prompts is not None and not is_prompt_file(self.prompts):
      raise ValueError(f"prompts {self.prompts!r} is not a JSONL prompt file (a path ending in "
                       ".jsonl or .json)")
    if self.chat_options and not self.chat_template:
      raise ValueError(f"chat_options {sorted(self.chat_options)} are switches of the chat "
                       "template, which this run does not use: set chat_template=true too")
    names = [dataset_name(d) for d in datasets_of(self)]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
      raise ValueError(f"datasets holds several entries named {clash} in tables and results "
                       "(a prompt file is named by its file name): rename one, or list each "
                       "once")
    for dataset in self.datasets:
      if dataset not in DATASETS and not is_prompt_file(dataset):
        raise ValueError(f"datasets holds {dataset!r}, which is no dataset: datasets are "
                         f"{list(DATASETS)} or JSONL prompt files (paths ending in .jsonl or "
                         ".json)")
    self.parsed_drafter_options()  # their syntax, before anything runs
    if self.mesh is not None and self.mesh != AUTO_MESH:
      check_mesh_spec(self.mesh)

  @property
  def sampling(self) -> SamplingConfig:
    """`temperature`, `top_k` and `top_p` as the one value the lab's runs pass along."""
    return SamplingConfig(self.temperature, self.top_k, self.top_p)

  def parsed_drafter_options(self) -> list[tuple[str, str, str, str]]:
    """(item, method, option, value text) of each `drafter_options` item, which must read
    method.option=value."""
    out = []
    for item in self.drafter_options:
      what, form = "drafter option", "method.option=value"
      key, value = config_utils.parse_assignment(item, what, form)
      name, _, option = key.partition(".")
      if not option or not value:
        raise ValueError(f"{what} {item!r} is not of the form {form}")
      out.append((item, name, option, value))
    return out

  def options_for(self, method: str) -> dict[str, Any]:
    """`method`'s builder options; values are Python literals (`4`, `[[0], [0, 0]]`) or text."""
    return {option: config_utils.parse_value(value)
            for _, name, option, value in self.parsed_drafter_options() if name == method}


def datasets_of(cfg: BenchmarkConfig) -> tuple[str, ...]:
  return (cfg.prompts,) if cfg.prompts else cfg.datasets


def dataset_name(dataset: str) -> str:
  """A dataset's label in tables: a prompt file by its name without extension."""
  return os.path.splitext(os.path.basename(dataset))[0] if is_prompt_file(dataset) else dataset


def is_prompt_file(dataset: str) -> bool:
  return dataset.endswith((".jsonl", ".json"))
