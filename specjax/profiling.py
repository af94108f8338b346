"""Where a verify step's time goes: its parts, each timed alone in a compiled loop.

Verifying a block of T = N + 1 tokens (the pending token and an N-node draft) is one target
forward with every block row's logits, the acceptance walk and the cache commit
(`decoding._verify_phase`). `verify_parts` times, for each T:

  * `forward`:      the target forward as the loop runs it (T rows of logits, a cache of
                    `cache_len` slots of which `prompt_len` are live);
  * `lm_head`:      what the LM head over T - 1 more rows costs: `forward` minus the same forward
                    that computes one row of logits;
  * `dead_slots`:   what attending the cache's not-yet-written slots costs: `forward` minus the
                    same forward over a cache of just the live slots and the block;
  * `accept`:       `verify.accept` on the block's logits (greedy, and sampled at T = 1);
  * `commit`:       `KVCache.commit` of the whole block;
  * `phase`:        the loop's whole verify phase (`profile_phases` with a chain of T - 1 nodes),
                    which also updates the history and counters, and its ratio to the one-token
                    phase: what `experiments.bench_roofline` reports as t_verify(N + 1) / t_step.

Each part runs inside a `lax.fori_loop` whose carry feeds the next iteration (nothing is hoisted
out of the loop or dropped as dead), timed as the difference between 2 * repeats and repeats
iterations, fastest of `trials` runs each, so dispatch and the call's fixed cost cancel.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checks, trees, verify
from specjax.decoding import MIN_BUCKET, bucket_length, cache_length, profile_phases
from specjax.drafters.oracle import Oracle
from specjax.models import decoder
from specjax.models.cache import KVCache
from specjax.sampling import SamplingConfig
from specjax.target import Target

# Each row's timed parts, in seconds (the order `bench_roofline` prints them in).
PARTS = ("forward", "lm_head", "dead_slots", "accept", "accept_sampled", "commit", "phase")


def per_iteration(body: Callable[[Any], Any], carry: Any, repeats: int, trials: int) -> float:
  """Seconds per iteration of `body: carry -> carry` run in a compiled `lax.fori_loop`: the
  fastest of `trials` runs of 2 * repeats iterations minus the fastest of `repeats`, over
  repeats (the runs interleaved, after one that compiles)."""
  loop = jax.jit(lambda n, c: jax.lax.fori_loop(0, n, lambda _, c: body(c), c))

  def wall(n: int) -> float:
    start = time.perf_counter()
    jax.block_until_ready(loop(n, carry))
    return time.perf_counter() - start

  wall(1)
  short, long = [], []
  for _ in range(trials):
    short.append(wall(repeats))
    long.append(wall(2 * repeats))
  return (min(long) - min(short)) / repeats


def _live_cache(target: Target, slots: int, live: int) -> KVCache:
  cfg = target.config
  cache = decoder.init_cache(cfg, 1, slots)
  rs = np.random.RandomState(1)
  k = rs.normal(size=cache.k.shape).astype(np.float32)
  v = rs.normal(size=cache.v.shape).astype(np.float32)
  return cache.replace(k=jnp.asarray(k, cache.k.dtype), v=jnp.asarray(v, cache.v.dtype),
                       length=jnp.full((1,), live, jnp.int32))


# The forward loops move the block over this many cache positions, one per iteration, so that
# what depends on the cache length (the attention mask, the rotary tables) is recomputed in each
# iteration as in the decode loop, instead of being hoisted out of a loop whose length is fixed.
_SHIFTS = 8


def _forward_loop(target: Target, t: int, cache: KVCache, one_logit: bool, repeats: int,
                  trials: int) -> float:
  """Per-iteration seconds of the verify forward on T tokens. The carry holds the cache (each
  forward writes the block into it, one slot further each time, cyclically), the tokens and a
  running max of the logits, which the next tokens depend on: every layer and the LM head stay
  inside the loop."""
  cfg = target.config
  live = cache.length
  mask = decoder.causal_mask(jnp.full((1,), t, jnp.int32), t)
  index = jnp.full((1, 1), t - 1, jnp.int32) if one_logit else None

  def body(c):
    cache, tokens, top = c
    positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    out = decoder.forward(cfg, target.params, tokens, positions, mask, cache, logits_index=index)
    top = jnp.maximum(top, jnp.max(out.logits).astype(jnp.float32))
    tokens = jnp.where(jnp.isnan(top), 0, tokens)
    length = live + (cache.length - live + 1) % _SHIFTS
    return out.cache.replace(length=length), tokens, top

  tokens = jnp.asarray(np.random.RandomState(t).randint(0, cfg.vocab_size, (1, t)), jnp.int32)
  return per_iteration(body, (cache, tokens, jnp.float32(-jnp.inf)), repeats, trials)


def _accept_loop(target: Target, t: int, sampling: SamplingConfig, repeats: int,
                 trials: int) -> float:
  """Per-iteration seconds of `verify.accept` on one block of logits; the carried logits take
  one in-place update from each result, so the walk cannot be hoisted."""
  v = target.config.vocab_size
  rs = np.random.RandomState(t)
  logits = jnp.asarray(rs.normal(size=(1, t, v)), jnp.float32)
  tree = trees.chain(jnp.asarray(rs.randint(0, v, (1, t - 1)), jnp.int32))

  def body(c):
    logits, key = c
    key, sub = jax.random.split(key)
    acc = verify.accept(tree, logits, sampling, sub)
    return logits.at[0, 0, 0].add(acc.tokens[0, 0].astype(jnp.float32) * 1e-30), key

  return per_iteration(body, (logits, jax.random.key(0)), repeats, trials)


def _commit_loop(cache: KVCache, t: int, repeats: int, trials: int) -> float:
  """Per-iteration seconds of committing a whole block of T slots (the length is reset after
  each commit, so every iteration moves the same slots)."""
  path = jnp.arange(t, dtype=jnp.int32)[None, :]
  n = jnp.full((1,), t, jnp.int32)

  def body(cache):
    return cache.commit(path, n).replace(length=cache.length)

  return per_iteration(body, cache, repeats, trials)


def _phase(target: Target, t: int, prompt_len: int, max_new: int, repeats: int,
           trials: int) -> float:
  """The loop's verify phase on a block of T: `profile_phases` with a chain of T - 1 nodes."""
  rs = np.random.RandomState(0)
  prompt = rs.randint(0, target.config.vocab_size, prompt_len).tolist()
  drafter = None
  if t > 1:
    reference = jnp.asarray(rs.randint(0, target.config.vocab_size, (1, max_new)), jnp.int32)
    drafter = Oracle(reference, jnp.asarray([prompt_len], jnp.int32), num_tokens=t - 1)
  return profile_phases(target, [prompt], drafter=drafter, max_new_tokens=max_new,
                        repeats=repeats, trials=trials)["t_verify"]


def verify_parts(target: Target, sizes: Sequence[int] = (1, 2, 4, 8, 16), *,
                 prompt_len: int = 128, max_new: int = 128, repeats: int = 20,
                 trials: int = 5) -> list[dict[str, float]]:
  """Seconds of each part of a verify step (module docstring) per block size T in `sizes`,
  batch 1, on a cache laid out as `generate` lays it out for a `prompt_len`-token prompt and
  `max_new` new tokens (the prompt's slots live). Each row also has `ratio`: phase / the T = 1
  phase (the cost of verifying T tokens in autoregressive steps)."""
  repeats = checks.integer("repeats", repeats, lo=1)
  trials = checks.integer("trials", trials, lo=1)
  limit = target.config.context_length
  rows = []
  for t in sizes:
    t = checks.integer("block size", t, lo=1)
    slots = cache_length(bucket_length(prompt_len, limit), max_new, t - 1, limit)
    full = _live_cache(target, slots, prompt_len)
    tight = _live_cache(target, max(prompt_len + _SHIFTS + t, MIN_BUCKET), prompt_len)
    forward = _forward_loop(target, t, full, False, repeats, trials)
    row = {"t": t, "cache_slots": slots, "forward": forward,
           "lm_head": forward - _forward_loop(target, t, full, True, repeats, trials),
           "dead_slots": forward - _forward_loop(target, t, tight, False, repeats, trials),
           "accept": _accept_loop(target, t, SamplingConfig(), repeats, trials),
           "accept_sampled": _accept_loop(target, t, SamplingConfig(temperature=1.0), repeats,
                                          trials),
           "commit": _commit_loop(full, t, repeats, trials),
           "phase": _phase(target, t, prompt_len, max_new, repeats, trials)}
    rows.append(row)
  base = next((r["phase"] for r in rows if r["t"] == 1), None)
  if base is None:
    base = _phase(target, 1, prompt_len, max_new, repeats, trials)
  for r in rows:
    r["ratio"] = r["phase"] / base
  return rows
