"""The benchmark behind `python -m experiments.benchmark` (Spec-Bench methodology).

For each dataset and method: one warm-up generation (compiles; excluded), then the same prompts,
batch 1, the same max_new_tokens for every method, autoregressive decoding measured in the same
run, the methods interleaved prompt by prompt (a drift in machine speed hits them alike).
Reported per (method, dataset): tau (emitted tokens / target calls), tokens/s, speedup vs
autoregressive, target calls, acceptance rate by depth, and per-phase timings (a round of
generate's own loop, and its verify phase timed in a compiled loop) giving the share of time
spent drafting and the ideal speedup tau * t_AR_step / (t_draft + t_verify) that a loop without
per-call costs would reach in decoding, and the same bound end to end, with each method's
prefill (prompt forward + drafter init) timed alone: what the measured speedup, which includes
the prefill, is judged against (loop efficiency).

With `mesh` set (e.g. "dp=2,tp=4") the target is placed on that device mesh (`Target.on_mesh`)
and every method's drafter with it (`drafters.build` lays it out by its partition rules);
results.json and the printout then also give the mesh and the parameter bytes each device holds
(`layout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from specjax import (
  assets,
  checks,
  config_utils,
  distributed,
  drafters,
  files,
  metrics,
  provenance,
  verify,
)
from specjax.decoding import bucket_length, check_rule, children_used, generate
from specjax.drafters import registry
from specjax.drafters.io import check_tree_options, load_drafter
from specjax.interop.hf import load_target
from specjax.interop.tokenizer import ChatTemplate
from specjax.lab.benchmark_config import (
  BenchmarkConfig,
  dataset_name,
  datasets_of,
  is_prompt_file,
)
from specjax.lab.phases import profile_phases
from specjax.lab.records import (
  AR,
  PHASES,
  SCHEMA_VERSION,
  MethodRecord,
  OracleRow,
  PhaseTimings,
  Roofline,
  add_speedups,
  finish,
)
from specjax.lab.report import dataset_table, markdown, plot
from specjax.rounds import prefill_chunks
from specjax.sampling import SamplingConfig
from specjax.sharding import bytes_per_device, describe, mesh_spec
from specjax.target import Target


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """The token-id prompts a run decodes from one dataset, and what choosing them did: the
  dataset's prompts (`available`), those without a single token (`empty`: skipped, a built-in
  dataset's empty files; a prompt file refuses them), and how many were cut to their last
  `max_prompt_tokens` tokens (`truncated`). Tables and results.json report them."""

  rows: list[list[int]]
  available: int
  empty: int
  truncated: int

  def summary(self) -> dict[str, int]:
    return {"prompts": len(self.rows), "available": self.available, "empty_skipped": self.empty,
            "truncated": self.truncated}


def load_prompts(target: Target, dataset: str, cfg: BenchmarkConfig) -> list[list[int]]:
  """Token-id prompts: HumanEval problem prompts, the openings of held-out stdlib files, held-out
  stdlib functions cut after their docstring, or the prompts of a JSONL file (rendered with the
  target's chat template under `chat_template`): `prompt_set(...).rows`."""
  return prompt_set(target, dataset, cfg).rows


def prompt_set(target: Target, dataset: str, cfg: BenchmarkConfig) -> PromptSet:
  """The first `cfg.num_prompts` prompts of `dataset` that have a token (see `load_prompts`),
  each keeping its last `cfg.max_prompt_tokens` tokens, with what that choice did (`PromptSet`)."""
  from specjax import data
  from specjax.data import prompts as prompt_files
  template = ChatTemplate.from_folder(cfg.target or assets.TARGET_DIR) if (
      cfg.chat_template) else None
  if dataset == "humaneval":
    prompts = [prompt_files.Prompt(text=ex["prompt"]) for ex in data.load_humaneval(cfg.data_dir)]
  elif dataset == "stdlib_heldout":
    prompts = [prompt_files.Prompt(text=ex["text"])
               for ex in data.load_stdlib_code("heldout", cfg.data_dir)]
  elif dataset == "stdlib_docstrings":
    prompts = [prompt_files.Prompt(text=ex["prompt"])
               for ex in data.load_stdlib_docstrings(cfg.data_dir)]
  elif is_prompt_file(dataset):
    prompts = prompt_files.read_prompts(dataset)
  else:
    raise ValueError(f"unknown dataset {dataset!r}; use 'humaneval', 'stdlib_heldout', "
                     "'stdlib_docstrings' or a JSONL prompt file")
  texts = []
  for i, p in enumerate(prompts):
    try:
      texts.append(prompt_files.render(p, template, **cfg.chat_options))
    except ValueError as e:  # the template's own errors, or a conversation without one
      where = f"the chat template of {cfg.target or assets.TARGET_DIR}, " if template else ""
      raise ValueError(f"{where}{dataset_name(dataset)} prompt {i + 1}: {e}") from None
  rows = [target.encode(t, add_special_tokens=template is None) for t in texts]
  kept = [r for r in rows if r]
  if len(kept) < len(rows) and is_prompt_file(dataset):
    n = next(i for i, r in enumerate(rows) if not r)
    raise ValueError(f"{dataset}: prompt {n + 1} encodes to no tokens; every prompt of a "
                     "prompt file must have text")
  if not kept:
    raise ValueError(f"dataset {dataset!r} has no prompt with a token")
  chosen = kept[:cfg.num_prompts]
  # Keep the end of long prompts: the continuation depends on the most recent context.
  return PromptSet(rows=[r[-cfg.max_prompt_tokens:] for r in chosen], available=len(kept),
                   empty=len(rows) - len(kept),
                   truncated=sum(len(r) > cfg.max_prompt_tokens for r in chosen))


@dataclasses.dataclass
class RunMemo:
  """What the `run_methods` calls of one run share: phase timings by setup (method, options,
  padded length, new tokens, sampling), and the (setup, batch size) pairs whose program already
  ran, which need no warm-up again."""

  phases: dict[tuple, PhaseTimings] = dataclasses.field(default_factory=dict)
  warm: set[tuple] = dataclasses.field(default_factory=set)


def run_methods(target: Target, runs: Sequence[tuple[str, dict[str, Any] | None]],
                prompts: Sequence[list[int]], cfg: BenchmarkConfig, bar=None, *,
                repeats: int = 1, profile: bool = True, batch_size: int = 1,
                memo: RunMemo | None = None, pad_to: int | None = None
                ) -> list[MethodRecord]:
  """Each (method, builder options or None for the config's) on every prompt.

  The runs are interleaved prompt by prompt (prompt 0 with every method, then prompt 1, ...), so
  a drift in the machine's speed during the benchmark hits every method alike instead of
  whichever ran during it; each run is warmed up (compiled) first. `repeats` times the whole
  pass again (tau, outputs and acceptance come from the first pass, the same seeds give the same
  tokens; `tokens_per_second_repeats` keeps each pass's speed); `batch_size` > 1 runs the prompts
  in batches of that many rows (ragged acceptance across rows; tau and `target_calls` then pool
  the calls each row took part in); `profile=False` skips the phase
  timings, which compile programs of their own.

  A method's phase timings depend on its shapes (its tree, the padded prompt length, the new
  tokens, the sampling mode), not on which prompt it decodes: `memo`, shared by the calls of one
  run (e.g. one per dataset), keeps them by method, options, padded length, new tokens and
  sampling, and a later call with the same reuses them (its records say `phases_reused`)
  instead of timing them again; nor does it warm up again a program an earlier call ran at the
  same batch size. `pad_to` pads the prompts to at least that
  many tokens: a run over several datasets passes the bucket of their longest prompt
  (`common_pad`), so each method runs one program, and times its phases once, for all of them.
  """
  if profile and cfg.max_new_tokens < 2:  # before any compile
    raise ValueError(f"phase timings need max_new_tokens >= 2 (a budget of one token runs no "
                     f"round to time), got {cfg.max_new_tokens}: raise it, or --set "
                     "profile=false")
  # One padded length for every prompt (one program per method), a bucket as generate's own:
  # runs over other prompts of a similar length then share the compiled programs.
  pad_to = max(pad_to or 0, common_pad(target, [prompts]))
  groups = [list(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size)]
  setups = []
  memo = RunMemo() if memo is None else memo
  sampling = cfg.sampling
  rule = verify.Rule(cfg.rule)
  for method, options in runs:  # every drafter built and its rule checked before any compiles
    options = cfg.options_for(method) if options is None else options
    drafter = None if method == AR else build_drafter(method, target, cfg, options)
    if drafter is not None:
      try:
        check_rule(drafter, sampling, rule)
      except verify.RuleMismatch as e:
        raise verify.RuleMismatch(f"{method} with rule={cfg.rule!r}: {e}") from None
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, drafter=drafter,
                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                  eos_token_id=[], pad_to=pad_to, rule=rule)
    setup_key = (method, repr(sorted(options.items())), cfg.drafter.get(method), pad_to,
                 cfg.max_new_tokens, sampling, rule)
    setups.append((method, drafter, kwargs, setup_key))
  if not sampling.greedy and any(m != AR for m, _ in runs):
    verify.warn_if_lossy(rule)  # once here, where it decides what is emitted, not per call
  for _, _, kwargs, setup_key in setups:
    if (setup_key, batch_size) not in memo.warm:
      with _quiet_lossy(rule):
        generate(target, groups[0], seed=cfg.seed, **kwargs)  # warm-up: compile, first calls
      memo.warm.add((setup_key, batch_size))
  acc = [{"tokens": 0, "calls": 0, "walls": [0.0] * repeats, "hist": None, "outputs": []}
         for _ in runs]
  base_postfix = getattr(bar, "postfix", None) or ""
  so_far = ""

  def show(*parts: str) -> None:
    bar.set_postfix_str(", ".join(x for x in (base_postfix, *parts) if x))
  for rep in range(repeats):
    for i, group in enumerate(groups):
      for (_, _, kwargs, _), a in zip(setups, acc):
        with _quiet_lossy(rule):
          r = generate(target, group, seed=cfg.seed + i, **kwargs)
        a["walls"][rep] += r.stats.wall_seconds
        if bar is not None:
          bar.update(1)
        if rep:
          continue
        a["tokens"] += r.stats.new_tokens
        a["calls"] += sum(r.stats.row_calls)  # batch 1: target_calls; pooled over rows
        h = np.asarray(r.stats.accepted_by_depth)
        a["hist"] = h if a["hist"] is None else a["hist"] + h
        a["outputs"] += r.tokens
      if bar is not None and not rep:
        so_far = running_figures([m for m, _ in runs], acc)
        show(so_far)
  records = []
  for (method, drafter, _, setup_key), a in zip(setups, acc):
    alpha = metrics.acceptance_by_depth(a["hist"])  # None where never reached (JSON)
    phases = None
    if profile:
      reused = setup_key in memo.phases
      if not reused:
        if bar is not None:  # the bar counts the timed runs: say what runs after them
          show(so_far, f"timing {method}'s phases")
        memo.phases[setup_key] = phase_timings(target, drafter, prompts[:1], cfg, pad_to)
      phases = dataclasses.replace(memo.phases[setup_key], phases_reused=reused)
    records.append(MethodRecord(
        method=method, tau=metrics.tau(a["tokens"], a["calls"]),
        tokens_per_second=repeats * a["tokens"] / sum(a["walls"]),
        tokens_per_second_repeats=[a["tokens"] / w for w in a["walls"]],
        target_calls=a["calls"], new_tokens=a["tokens"], wall_seconds=a["walls"][0],
        acceptance_by_depth=alpha, accepted_by_depth=a["hist"].tolist(),
        batch_size=batch_size, outputs=a["outputs"], prompts=len(prompts),
        prefill_chunks=sum(max(prefill_chunks(len(p), pad_to) for p in group)
                           for group in groups),
        draft_nodes=0 if drafter is None else drafter.num_nodes,
        **({} if drafter is None else drafting(drafter, sampling, rule)), phases=phases,
        param_bytes=None if target.mesh is None or drafter is None
        else param_bytes(drafter, target.mesh)))
  if bar is not None:
    bar.set_postfix_str(base_postfix)  # the caller's postfix: a later call starts from it
  return records


def drafting(drafter, sampling: SamplingConfig, rule: verify.Rule) -> dict[str, Any]:
  """A drafter's run's `children`, `rule` and `lossy`, as its record holds them: at T = 0 the
  children are its top-k and verification is greedy matching, whatever the options ask."""
  if sampling.greedy:
    return {"children": children_used(drafter, sampling), "rule": "greedy", "lossy": False}
  return {"children": children_used(drafter, sampling), "rule": rule.name, "lossy": rule.lossy}


@contextlib.contextmanager
def _quiet_lossy(rule: verify.Rule):
  """Inside: no `LossyRuleWarning` for `rule`, of which `run_methods` has warned once already,
  not at each of its generate calls."""
  with warnings.catch_warnings():
    if rule.lossy:
      warnings.simplefilter("ignore", verify.LossyRuleWarning)
    yield


def common_pad(target: Target, prompt_sets: Sequence[Sequence[list[int]]]) -> int:
  """The padded prompt length of a run over `prompt_sets`: the bucket of their longest prompt."""
  longest = max(len(p) for prompts in prompt_sets for p in prompts)
  return bucket_length(longest, target.config.max_position_embeddings)


def running_figures(methods: Sequence[str], acc: Sequence[dict[str, Any]]) -> str:
  """The progress bar's figures while a dataset runs: autoregressive tokens/s and the fastest
  method's speedup over it, on the prompts done so far ('' before AR has run or without it)."""
  speed = {m: a["tokens"] / a["walls"][0] for m, a in zip(methods, acc) if a["walls"][0] > 0}
  if AR not in speed:
    return ""
  text = f"so far: AR {speed[AR]:.0f} tok/s"
  others = {m: v for m, v in speed.items() if m != AR}
  if others:
    best = max(others, key=others.get)
    text += f", best {best} {others[best] / speed[AR]:.2f}x"
  return text


def phase_timings(target: Target, drafter, prompts: Sequence[list[int]], cfg: BenchmarkConfig,
                  pad_to: int) -> PhaseTimings:
  """`profile_phases` of one method in ms, as a record holds them."""
  with _quiet_lossy(verify.Rule(cfg.rule)):
    phases = profile_phases(target, prompts, drafter=drafter, repeats=cfg.profile_repeats,
                            max_new_tokens=cfg.max_new_tokens, pad_to=pad_to,
                            sampling=cfg.sampling, rule=cfg.rule)
  return PhaseTimings(
      **{f"{name}_ms": phases[name] * 1e3 for name in PHASES},
      **{f"{name}_spread_ms": phases[f"{name}_spread"] * 1e3 for name in PHASES},
      prefill_chunks_timed=max(prefill_chunks(len(p), pad_to) for p in prompts))


def build_drafter(method: str, target: Target, cfg: BenchmarkConfig, options: dict[str, Any]):
  """`method`'s drafter: from its folder in `cfg.drafter` when it has one, else the registry's
  default (the shipped drafter). On a target with a mesh it is placed there by its partition
  rules."""
  path = cfg.drafter.get(method)
  if path is None:
    return drafters.build(method, target, **options)
  if method in drafters.names():
    return drafters.build(method, target, path=path, **options)
  return load_drafter(path, target, **options)


def param_bytes(tree: Any, mesh) -> dict[str, int]:
  """Bytes of `tree`'s arrays as laid out on `mesh`: `min` / `max` over this process's devices of
  the mesh (a device holding none counts as 0), `total` over them (replicas counted each time)
  and `one_copy`, the arrays' unsharded size: total / one_copy is how often they are stored."""
  held = bytes_per_device(tree)
  ours = [held.get(d.id, 0) for d in mesh.devices.flat if d.process_index == jax.process_index()]
  leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  return {"min": min(ours), "max": max(ours), "total": sum(ours),
          "one_copy": sum(int(x.size) * x.dtype.itemsize for x in leaves)}


def layout(target: Target, records: Sequence[MethodRecord]) -> dict[str, Any]:
  """The mesh of a run and the parameter bytes per device of the target and of each drafter
  (from the records of `run_methods`), for results.json and `markdown`."""
  by_method = {"target": param_bytes(target.params, target.mesh)}
  for r in records:
    if r.param_bytes is not None:
      by_method.setdefault(r.method, r.param_bytes)
  return {"mesh": describe(target.mesh), "mesh_spec": mesh_spec(target.mesh),
          "param_bytes": by_method}


def configured_target(cfg: BenchmarkConfig) -> Target:
  """The config's target (the embedded default unless `target` names a folder), on its mesh."""
  path = cfg.target or assets.TARGET_DIR
  if not os.path.exists(os.path.join(path, "config.json")):
    raise ValueError(f"no target at {path}: train the embedded default with "
                     "`python -m experiments.train_target` or pass --set target=DIR")
  target = load_target(path, dtype=cfg.dtype)
  return target if cfg.mesh is None else target.on_mesh(cfg.mesh)


def methods_of(cfg: BenchmarkConfig, target: Target) -> list[str]:
  """The methods a run measures, AR first: `cfg.methods`, or by default every available method
  and every drafter given a folder."""
  methods = list(cfg.methods) or [AR] + drafters.available(target)
  if not cfg.methods:
    methods += [m for m in cfg.drafter if m not in methods]
  # Speedups are measured against AR in the same run.
  return [AR] + [m for m in methods if m != AR]


def check_drafter_folders(cfg: BenchmarkConfig, methods: Sequence[str]) -> None:
  """A folder labelled with a name the run neither measures nor registers (`drafter.<label>`
  with `methods` naming others) would be ignored, silently: a typo of the label, most often."""
  unused = sorted(set(cfg.drafter) - set(methods) - set(drafters.names()))
  if unused:
    raise ValueError(f"drafter.{unused[0]} labels a folder the run does not measure (methods: "
                     f"{list(methods)}): add {unused[0]!r} to methods, or remove the label")


def check_drafter_options(cfg: BenchmarkConfig, methods: Sequence[str]) -> None:
  """Every `drafter_options` item names a method: one of the run's, a registered drafter or a
  labelled folder (`drafter`; a config may set options for methods a --set leaves out). One
  naming none (a typo, or a list written as one item) would apply to nothing, silently."""
  known = set(methods) | set(drafters.names()) | set(cfg.drafter)
  for item, name, option, _ in cfg.parsed_drafter_options():
    if name not in known:
      raise ValueError(f"drafter option {item!r} names {name!r}, which is no method: not one "
                       f"of the run's {list(methods)}, a registered drafter or a labelled "
                       "folder (one option per item: --set "
                       "drafter_options=method.option=value,...)")
    # The option's name, checked now (also for a method this run leaves out), not after the
    # methods before it were measured. Its value is the builder's to check.
    if name not in drafters.names():
      continue  # a labelled folder: its family is known once it is read
    accepted = registry.option_names(name)
    try:
      if accepted is None:  # a learned family's builder: its tree options
        check_tree_options(name, {option: None})
      else:
        checks.known_options(f"drafter {name!r}", [option], accepted)
    except ValueError as e:
      raise ValueError(f"drafter option {item!r}: {e}") from None


def run(cfg: BenchmarkConfig, report: Callable[[str], None] | None = None
        ) -> list[MethodRecord]:
  """Every method on every dataset; writes results.json, results.md and the plots to `cfg.out`.
  `report` (e.g. `print`) receives each dataset's table as soon as that dataset is done."""
  if distributed.is_main_process():  # before measuring
    files.check_output_dir(cfg.out, "results folder (out)")
  target = configured_target(cfg)
  methods = methods_of(cfg, target)
  check_drafter_folders(cfg, methods)
  check_drafter_options(cfg, methods)
  sets = {dataset_name(d): prompt_set(target, d, cfg) for d in datasets_of(cfg)}
  prompts = {name: s.rows for name, s in sets.items()}
  records, memo = [], RunMemo()
  pad_to = common_pad(target, list(prompts.values()))
  total = sum(len(p) for p in prompts.values()) * len(methods)
  with tqdm(total=total, desc="benchmark", dynamic_ncols=True) as bar:
    for dataset, rows in prompts.items():
      bar.set_postfix(dataset=dataset)
      group = [dataclasses.replace(r, dataset=dataset, prompt_set=sets[dataset].summary())
               for r in run_methods(target, [(m, None) for m in methods], rows, cfg, bar,
                                    profile=cfg.profile, memo=memo, pad_to=pad_to)]
      if cfg.profile:
        finish(group)
      else:
        add_speedups(group)
      records += group
      if report is not None and distributed.is_main_process():
        with tqdm.external_write_mode():  # the bar steps aside
          report("\n".join(["", *dataset_table(group, cfg), ""]))
  if not distributed.is_main_process():
    return records  # a multi-process run writes its results once, from process 0
  mesh_layout = None if target.mesh is None else layout(target, records)
  write_results(cfg, records, provenance.collect(cfg), mesh_layout)
  return records


def write_results(cfg: BenchmarkConfig, records: Sequence[MethodRecord], block: dict[str, Any],
                  mesh_layout: dict[str, Any] | None = None) -> list[str]:
  """results.json, results.md and the plots in `cfg.out`, replaced together
  (`files.atomic_group`): a failure while writing any of them (a full disk) leaves the previous
  results whole and consistent. `block`: the run's provenance. Returns the paths."""
  assets.check_not_shipped(cfg.out, "the results folder (out)")
  out = cfg.out
  with files.atomic_group() as group:
    # allow_nan=False: the file stays valid JSON (undefined ratios are null, never NaN).
    paths = [group.write_json(
        os.path.join(out, "results.json"),
        {"schema_version": SCHEMA_VERSION, "config": config_utils.to_dict(cfg),
         "provenance": block, "records": [r.to_json() for r in records],
         **({} if mesh_layout is None else {"layout": mesh_layout})},
        indent=1, allow_nan=False)]
    paths.append(group.write_text(os.path.join(out, "results.md"),
                                  markdown(records, cfg, provenance.header(block), mesh_layout)))
    paths += plot(records, out, group)
  return paths


def sweep_trees(method: str, candidates: Sequence[dict[str, Any]], cfg: BenchmarkConfig
                ) -> list[MethodRecord]:
  """Measures `method` with each tree option set beside AR on the same prompts (cfg.datasets,
  e.g. held-out stdlib files: tune on data the benchmark table does not report)."""
  target = configured_target(cfg)
  prompts = [p for d in datasets_of(cfg) for p in load_prompts(target, d, cfg)]
  with tqdm(total=len(prompts) * (len(candidates) + 1), desc=f"sweep {method}",
            dynamic_ncols=True) as bar:
    runs = [(AR, {})] + [(method, dict(options)) for options in candidates]
    records = [dataclasses.replace(r, options=options) for r, (_, options)
               in zip(run_methods(target, runs, prompts, cfg, bar), runs)]
  finish(records)
  return records


def oracle_roofline(target: Target, prompt: list[int], chains: Sequence[int], max_new: int,
                    repeats: int) -> Roofline:
  """The loop's best case on one prompt: an oracle chain of N (`drafters.oracle`) drafts the
  target's own greedy continuation, so every node is accepted. Per N: tau, the cost of verifying
  N + 1 tokens in AR steps, the bound t_AR * (N + 1) / t_verify(N + 1), the bound at the realised
  tau (the last round is cut at max_new), the end-to-end bound with the prefill both runs pay, and
  the measured speedup. Every timing is the fastest of `repeats` runs, the measured generations
  included: one run each would let a slow autoregressive pass lift every oracle's speedup above
  its own bound."""
  import jax.numpy as jnp

  from specjax.drafters.oracle import Oracle
  kw = dict(max_new_tokens=max_new, eos_token_id=[])

  def fastest(drafter=None):
    """(the run, its fastest tokens/s over `repeats` runs after a warm-up)."""
    generate(target, [prompt], drafter=drafter, **kw)
    runs = [generate(target, [prompt], drafter=drafter, **kw) for _ in range(repeats)]
    return runs[0], max(r.stats.tokens_per_second for r in runs)

  ar, ar_tps = fastest()
  reference = jnp.asarray([ar.tokens[0]], jnp.int32)
  t_ar = profile_phases(target, [prompt], max_new_tokens=max_new, repeats=repeats)["t_verify"]
  # The prompt's prefill is part of every measured generation; time it alone so the bound can
  # include it (it weighs most when a long chain leaves few rounds).
  generate(target, [prompt], max_new_tokens=1, eos_token_id=[])
  t_pre = min(generate(target, [prompt], max_new_tokens=1, eos_token_id=[]).stats.wall_seconds
              for _ in range(repeats))
  rows = []
  for n in chains:
    oracle = Oracle(reference, jnp.asarray([len(prompt)], jnp.int32), num_tokens=n)
    r, tps = fastest(oracle)
    if r.tokens != ar.tokens:
      raise AssertionError("oracle drafting changed the output")
    t_v = profile_phases(target, [prompt], drafter=oracle, max_new_tokens=max_new,
                         repeats=repeats)["t_verify"]
    bound_e2e = (t_pre + (max_new - 1) * t_ar) / (t_pre + (r.stats.target_calls - 1) * t_v)
    rows.append(OracleRow(n=n, tau=r.stats.tau, cost=t_v / t_ar, bound=t_ar * (n + 1) / t_v,
                          bound_tau=t_ar * r.stats.tau / t_v, bound_e2e=bound_e2e,
                          speedup=tps / ar_tps))
  return Roofline(ar_tps, t_ar * 1e3, t_pre * 1e3, tuple(rows))

