"""Where a round's time goes: seconds per round of the draft and the verify phase, and of the
prefill, measured with `generate`'s own compiled program (`profile_phases`), and whole rounds of
that loop to look inside with a profiler (`round_loop`)."""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checks, decoding, rounds, timing, verify
from specjax.decoding import Prepared
from specjax.drafters.base import Drafter, NoDrafter
from specjax.models.cache import KVCache
from specjax.rounds import DecodeState, Loop
from specjax.sampling import GREEDY, SamplingConfig
from specjax.target import Target


def profile_phases(target: Target, prompts, *, drafter: Drafter | None = None,
                   max_new_tokens: int = 64, repeats: int = 20,
                   sampling: SamplingConfig = GREEDY, pad_to: int | None = None,
                   trials: int = 5, rule: verify.Rule | str | None = None
                   ) -> dict[str, float]:
  """Seconds per round of the verify phase and of the draft phase, and of the prefill (the
  prompt's forward plus the drafter's `init`), each with its spread across trials.

  A round and the prefill are timed with `generate`'s own compiled program, which a benchmark
  has compiled already: given a budget of one token it runs the prefill alone, given
  `max_new_tokens` it runs the prefill and then R rounds (`rounds` in the state it returns), so
  t_round = (t_full - t_prefill) / R is what a round of `generate`'s loop costs, its loop
  condition and bookkeeping included, with the call's fixed cost cancelled. Each call writes
  into a fresh cache it takes over, as `generate`'s does; t_full and t_prefill are each the
  fastest of `trials` calls after as many untimed ones (on a mesh the first few run up to 2x
  slower). The verify phase alone runs in one more program (`_verify_loop_program`): one draft
  from the prefilled state, then its verification chained `2 * repeats` times inside a
  `lax.fori_loop`, timed as the fastest of `trials` runs less the fastest call of none, so
  per-call dispatch is not counted. Every trial runs all four calls one after the other, so a
  drift in the machine's speed hits them alike. t_draft = t_round - t_verify is what a round
  costs beyond its verify phase. Autoregressive decoding (no drafter) needs no second program:
  its round is its verify step, and its t_draft is 0 by definition.

  `<name>_spread` is the range (max - min) of the per-trial estimates. Nothing is clamped: a
  difference of noisy timings can come out negative, and a caller judging the figures needs to
  see that (`specjax.lab.benchmark` marks such cells). `rule` is `generate`'s acceptance rule
  (at T > 0 its verify phase is the rule's). The ideal speedup of a method is
  tau * t_AR_step / (t_draft + t_verify); a run gets close to it when its prefill and its
  per-call costs are small beside its rounds.
  """
  trials = checks.integer("trials", trials, lo=1)
  repeats = checks.integer("repeats", repeats, lo=1)
  # One round at least: a budget of one token is the prefill alone.
  max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=2)
  run = prepare(target, prompts, drafter, max_new_tokens, sampling, pad_to, rule)
  with decoding.mesh_context(run.spec.mesh):
    return _profile(run, repeats, trials)


def prepare(target: Target, prompts, drafter: Drafter | None, max_new_tokens: int,
            sampling: SamplingConfig, pad_to: int | None,
            rule: verify.Rule | str | None = None) -> Prepared:
  """The profiler's program inputs (seed 0, no EOS; None: no drafter)."""
  drafter = NoDrafter() if drafter is None else drafter
  return decoding.prepare(target, prompts, max_new_tokens, drafter, sampling, 0, [], pad_to,
                          rule)


def budget_runs(run: Prepared) -> tuple[Callable[[KVCache, bool], DecodeState], DecodeState]:
  """`call(cache, prefill_only)` runs `generate`'s compiled program on `run` into `cache`
  (taking it over, as `generate` does): with `run`'s budget, or with a budget of one token,
  after which it stops, its prefill done. Also returns the prefill's state on a fresh cache,
  ready to decode: `run`'s budget back and its rows live again (the profiler's prompts stop at
  no EOS, so only batch padding is done)."""
  cache = run.fresh_cache()  # what the program is compiled for, then the prefill's own
  program, _ = decoding.compiled(run.spec, run.args, cache)
  budgets = {False: run.args, True: run.args.replace(max_new=jnp.ones_like(run.args.max_new))}

  def call(cache: KVCache, prefill_only: bool) -> DecodeState:
    return program(budgets[prefill_only], cache)

  prefilled = call(cache, True)
  return call, prefilled.replace(done=~run.args.live, max_new=run.args.max_new)


# The profiler's verify loop, jitted once at module level (the spec is static; the loop count is
# traced), so profiling the same method, shapes and sampling mode again reuses it.
@functools.partial(jax.jit, static_argnums=0)
def _verify_loop_program(spec: rounds.Spec, args: rounds.ProgramArgs, state: DecodeState,
                         n_verify, size) -> DecodeState:
  """From a prefilled `state`: one draft, then `n_verify` verify phases of that draft, each at
  the drafter's verify size of index `size` (traced: one program for all of them)."""
  loop = Loop.of(spec, args)
  tree, state, key = rounds.draft_phase(loop, state)
  return jax.lax.fori_loop(
      0, n_verify, lambda i, s: rounds.verify_phase(loop, tree, s, key, size), state)


def _rounds(spec: rounds.Spec, args: rounds.ProgramArgs, state: DecodeState, n_round
            ) -> DecodeState:
  """From a prefilled `state`: `n_round` whole rounds (draft, then verify) in a fori loop."""
  loop = Loop.of(spec, args)
  return jax.lax.fori_loop(0, n_round, lambda i, s: rounds.run_round(loop, s), state)


def round_loop(target: Target, prompts, *, drafter: Drafter | None = None,
               max_new_tokens: int = 64, sampling: SamplingConfig = GREEDY,
               pad_to: int | None = None):
  """Whole rounds of `generate`'s loop from a prefilled state, for tools that look inside them
  (e.g. `specjax.lab.profiling.kernel_times`): returns `(run, hlo)`, where `run(n)` runs n whole
  rounds (draft, then verify) in a loop of their own and waits for them, and `hlo` is the
  compiled program's optimized HLO text (whose instruction names are the kernels a profiler
  sees)."""
  prepared = prepare(target, prompts, drafter, max_new_tokens, sampling, pad_to)
  spec, args = prepared.spec, prepared.args
  with decoding.mesh_context(spec.mesh):
    _, state = budget_runs(prepared)
    # The op metadata (named scopes) is the point here, and the compilation caches key
    # programs without it: a program could come back from memory or disk as compiled from an
    # older version of the code, with that version's metadata. A function of its own (traced
    # and lowered afresh) with the metadata in the persistent cache's key cannot.
    def profiled_loops(args, state, n):
      return _rounds(spec, args, state, n)

    lowered = jax.jit(profiled_loops).lower(args, state, 0)
    key_option = "jax_compilation_cache_include_metadata_in_key"
    before = getattr(jax.config, key_option)
    jax.config.update(key_option, True)
    try:
      compiled = lowered.compile()
    finally:
      jax.config.update(key_option, before)

  def run(n: int) -> DecodeState:
    with decoding.mesh_context(spec.mesh):
      return jax.block_until_ready(compiled(args, state, n))

  return run, compiled.as_text()


def _profile(run: Prepared, repeats: int, trials: int) -> dict[str, float]:
  call_program, state = budget_runs(run)
  drafter = run.args.drafter
  n = 2 * repeats

  def call(prefill_only: bool) -> tuple[float, DecodeState]:
    cache = jax.block_until_ready(run.fresh_cache())  # fresh: donated
    begin = time.perf_counter()
    out = jax.block_until_ready(call_program(cache, prefill_only))
    return time.perf_counter() - begin, out

  def verify(k: int, size: int = 0) -> DecodeState:
    return jax.block_until_ready(_verify_loop_program(run.spec, run.args, state, k,
                                                      np.int32(size)))

  # The first `trials` calls of each warm up (on a mesh the first few run up to 2x slower); then
  # every timing of a trial runs beside the others, so a drift in the machine's speed hits them
  # alike (t_draft is a difference of two of them).
  for _ in range(trials):
    call(True)
    _, out = call(False)
  # A drafter with several verify sizes: each size the run used is timed, and the verify phase
  # is their mean weighted by the run's rounds at each.
  n_rounds, by_size = int(decoding.to_host(out.rounds)), decoding.to_host(out.size_hist)
  used = [i for i, k in enumerate(by_size) if k > 0]
  if drafter.num_nodes:
    for i in used:  # compiles the loop and runs each size's verification once: a first is slow
      verify(1, i)
  times = collections.defaultdict(list)
  for _ in range(trials):
    times["prefill"].append(call(True)[0])
    times["full"].append(call(False)[0])
    if drafter.num_nodes:
      times["none"].append(timing.wall(functools.partial(verify, 0)))
      for i in used:
        times[i].append(timing.wall(functools.partial(verify, n, i)))
  return _phases(times, by_size, used, n_rounds, n, bool(drafter.num_nodes))


def _phases(times: dict, by_size: np.ndarray, used: list[int], n_rounds: int, n: int,
            drafts: bool) -> dict[str, float]:
  """The per-round phase times (and their spreads across trials) from the trials' timings."""
  prefill = np.asarray(times["prefill"])
  t_round, round_trials = timing.per_unit(times["full"], prefill, n_rounds)

  def spread(per_trial: np.ndarray) -> float:
    return float(per_trial.max() - per_trial.min())

  if drafts:
    weights = by_size[used] / by_size[used].sum()
    per_size = [timing.per_unit(times[i], times["none"], n) for i in used]
    t_verify = float(sum(w * t for w, (t, _) in zip(weights, per_size)))
    verify_trials = sum(w * trials_i for w, (_, trials_i) in zip(weights, per_size))
    t_draft, draft_spread = t_round - t_verify, spread(round_trials - verify_trials)
  else:
    t_verify, verify_trials = t_round, round_trials
    t_draft, draft_spread = 0.0, 0.0
  return {
      "t_prefill": float(prefill.min()), "t_prefill_spread": spread(prefill),
      "t_draft": float(t_draft), "t_draft_spread": draft_spread,
      "t_verify": float(t_verify), "t_verify_spread": spread(verify_trials),
  }
