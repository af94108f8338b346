"""The peers table: transformers' generate, assisted generation and prompt lookup beside
specjax's autoregressive decoding, draft LM and prompt lookup, on the same checkpoint, prompts
and machine."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from specjax import assets
from specjax.config_utils import NonNegInt, config
from specjax.drafters import registry
from specjax.lab import report
from specjax.lab.benchmark_config import BenchmarkConfig
from specjax.lab.records import AR, MethodRecord, TableRow
from specjax.lab.session import Result, Session, Table, public
from specjax.sharding import describe

PEER_METHODS = (AR, "draft_lm", "prompt_lookup")


@config
class PeersTable:
  threads: NonNegInt = 0  # torch threads; 0 = the cores JAX's client uses

  def check(self, cfg: BenchmarkConfig) -> None:
    """Nothing to check against the job's fields: the table's methods are fixed."""


@dataclasses.dataclass(kw_only=True)
class TransformersRun:
  """transformers' run of one method over the prompts: what a specjax record says of it."""

  implementation: str  # "transformers <version>"
  method: str  # the specjax method it runs beside
  tokens_per_second: float
  tau: float  # new tokens / the target's forward calls (prefill included)
  target_calls: int
  new_tokens: int
  outputs: list[list[int]]
  torch_threads: int

  def to_json(self, outputs: bool = True) -> dict[str, Any]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if outputs or f.name != "outputs"}


@dataclasses.dataclass
class PeerRow(TableRow):
  """A run of either implementation, against its own greedy run and specjax's outputs."""

  record: MethodRecord | TransformersRun
  implementation: str
  speedup_over_own_greedy: float
  matches_specjax_greedy: bool


def jax_threads() -> int:
  """The cores XLA's CPU client runs on (its thread pool is sized by the process's affinity)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def units(s: Session, t: PeersTable) -> int:
  return len(s.prompts(s.first_dataset)) * 2 * len(PEER_METHODS)


def _hf_runs(s: Session, prompts: Sequence[list[int]], threads: int) -> list[TransformersRun]:
  """transformers' greedy generate, assisted generation with the draft LM and prompt lookup on
  the same checkpoint and prompts, interleaved prompt by prompt after one warm-up each."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ValueError(f"the peers table runs transformers beside specjax and needs torch and "
                     f"transformers ({e}); install them with pip install -e \".[test]\"") from None
  log = transformers.logging
  threads_before, verbosity_before = torch.get_num_threads(), log.get_verbosity()
  bars_before = log.is_progress_bar_enabled()
  torch.set_num_threads(threads)
  # Under reproduce's own progress bar: no loading bars, and no warning that transformers'
  # assisted generation raises about its own call to the assistant's `generate`.
  log.disable_progress_bar()
  log.set_verbosity_error()
  try:
    return _hf_measure(s, prompts, torch, transformers)
  finally:
    torch.set_num_threads(threads_before)
    log.set_verbosity(verbosity_before)
    if bars_before:
      log.enable_progress_bar()


def _hf_measure(s: Session, prompts, torch, transformers) -> list[TransformersRun]:
  cfg = s.cfg
  draft_lm_options = {**registry.defaults("draft_lm"), **cfg.options_for("draft_lm")}
  lookup_options = {**registry.defaults("prompt_lookup"), **cfg.options_for("prompt_lookup")}
  load = transformers.AutoModelForCausalLM.from_pretrained
  model = load(cfg.target or assets.TARGET_DIR, dtype=torch.float32).eval()
  draft = load(cfg.drafter.get("draft_lm", assets.DRAFT_LM_DIR), dtype=torch.float32).eval()
  draft.generation_config.num_assistant_tokens = draft_lm_options["num_tokens"]
  draft.generation_config.num_assistant_tokens_schedule = "constant"
  # transformers stops drafting early below this draft probability (0.4 by default); specjax's
  # draft LM always drafts its num_tokens, and 0 turns the early stop off: the same algorithm.
  draft.generation_config.assistant_confidence_threshold = 0.0
  calls = [0]
  model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
  n = cfg.max_new_tokens
  runs = {AR: {}, "draft_lm": {"assistant_model": draft},
          "prompt_lookup": {"prompt_lookup_num_tokens": lookup_options["num_tokens"],
                            "max_matching_ngram_size": lookup_options["max_ngram"]}}

  def one(prompt, extra):
    calls[0] = 0
    start = time.perf_counter()
    with torch.no_grad():
      ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
    return ids[0, len(prompt):].tolist(), time.perf_counter() - start, calls[0]

  acc = {m: {"outputs": [], "wall": 0.0, "calls": 0} for m in runs}
  for extra in runs.values():
    one(prompts[0], extra)  # warm-up
  for prompt in prompts:
    for m, extra in runs.items():
      tokens, wall, c = one(prompt, extra)
      acc[m]["outputs"].append(tokens)
      acc[m]["wall"] += wall
      acc[m]["calls"] += c
      if s.bar is not None:
        s.bar.update(1)
  records = []
  for m, a in acc.items():
    new = sum(map(len, a["outputs"]))
    records.append(TransformersRun(
        implementation=f"transformers {transformers.__version__}", method=m,
        tokens_per_second=new / a["wall"], tau=new / a["calls"], target_calls=a["calls"],
        new_tokens=new, outputs=a["outputs"], torch_threads=torch.get_num_threads()))
  return records


def build(s: Session, t: PeersTable, out: str) -> Result:
  cfg, dataset = s.cfg, s.first_dataset
  prompts = s.prompts(dataset)
  mine = s.measure(dataset, [(m, None) for m in PEER_METHODS])
  threads = t.threads or jax_threads()
  hf = _hf_runs(s, prompts, threads)
  reference = mine[0].outputs
  ours, theirs = ([PeerRow(r, implementation=implementation,
                           speedup_over_own_greedy=r.tokens_per_second / runs[0].tokens_per_second,
                           matches_specjax_greedy=r.outputs == reference) for r in runs]
                  for runs, implementation in ((mine, "specjax"), (hf, hf[0].implementation)))
  records = ours + theirs
  names = {AR: "greedy", "draft_lm": "draft LM", "prompt_lookup": "prompt lookup"}
  hf_names = {AR: "greedy `generate`", "draft_lm": "assisted generation (`assistant_model=`)",
              "prompt_lookup": "prompt lookup (`prompt_lookup_num_tokens=`)"}
  rows = [[r.implementation,
           (names if r.implementation == "specjax" else hf_names)[r.record.method],
           f"{r.record.tokens_per_second:.1f}",
           f"{r.record.tau:.2f}", f"{r.speedup_over_own_greedy:.2f}x",
           "yes" if r.matches_specjax_greedy else "no"] for r in records]
  lines = [f"### specjax beside transformers on {dataset} (T = 0, {len(prompts)} prompts x "
           f"{cfg.max_new_tokens} new tokens, batch 1, same checkpoint)", ""]
  lines += report.table(["implementation", "method", "tokens/s", "tau",
                         "speedup over its own greedy", "output = specjax greedy"], rows)
  lines += [f"torch runs on {threads} threads, the number of cores JAX's CPU client uses "
            f"({jax_threads()} here); specjax on {describe(s.target.mesh)} (the config's mesh: "
            "auto splits the target over every core). Both draft with the same draft LM and the "
            "same number of tokens (transformers' constant schedule, its early stop on draft "
            "confidence off) and look up the same n-gram sizes. tau for transformers counts the "
            "target's forward calls (prefill included), as specjax's does.", ""]
  figure = _plot(ours, theirs, names, os.path.join(out, "peers.png"))
  return Result("\n".join(lines), {"records": public(records), "torch_threads": threads},
                [figure])


def _plot(ours: list[PeerRow], theirs: list[PeerRow], names, path: str) -> str:
  """tokens/s of each method, specjax's bar beside transformers'."""
  plt = report.pyplot()
  fig, ax = plt.subplots(figsize=(8, 4))
  x = np.arange(len(PEER_METHODS))
  for i, group in enumerate((ours, theirs)):
    ax.bar(x + (i - 0.5) * 0.4, [r.record.tokens_per_second for r in group], 0.4,
           label=group[0].implementation)
  ax.set_xticks(x, [names[m] for m in PEER_METHODS])
  ax.set(title="tokens/s, same checkpoint and prompts", ylabel="tokens/s")
  ax.legend()
  return report.save(fig, path)


TABLE = Table("peers", PeersTable, build, units)
