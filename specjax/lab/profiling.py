"""Where a verify step's time goes: its parts, each timed alone in a compiled loop.

Verifying a block of T = N + 1 tokens (the pending token and an N-node draft) is one target
forward with every block row's logits, the acceptance walk and the cache commit
(`rounds.verify_phase`). `verify_parts` times, for each T:

  * `forward`:      the target forward as the loop runs it (T rows of logits, a cache of
                    `cache_len` slots of which `prompt_len` are live);
  * `lm_head`:      what the LM head over T - 1 more rows costs: `forward` minus the same forward
                    that computes one row of logits;
  * `dead_slots`:   what attending the cache's not-yet-written slots costs: `forward` minus the
                    same forward over a cache of just the live slots and the block;
  * `accept`:       `verify.accept` on the block's logits (greedy, and sampled at T = 1);
  * `commit_chain`: the loop's commit of a chain's block (`rounds.commit_round`: the length
                    advances, no rows move);
  * `commit_tree`:  the commit of a tree whose accepted path is the whole block (every layer's
                    rows gathered into place);
  * `phase`:        the loop's whole verify phase (`profile_phases` with a chain of T - 1 nodes),
                    which also updates the history and counters, and its ratio to the one-token
                    phase: what `experiments.bench_roofline` reports as t_verify(N + 1) / t_step.

Each part runs inside a `lax.fori_loop` whose carry feeds the next iteration (nothing is hoisted
out of the loop or dropped as dead), timed as 2 * repeats iterations less none, fastest of
`trials` runs each (`specjax.timing`), so dispatch and the call's fixed cost cancel.

`kernel_times` looks inside a whole decode round instead, with JAX's profiler: every kernel the
compiled program runs (an XLA fusion, a dot, a copy), filed by the named scopes the model and
the loop set (`PHASE_SCOPES`, `PART_SCOPES`: e.g. `verify/attention`, `draft/mlp`), with how many
kernels each part launches per round. On a CPU a small model's step is often more kernels than
arithmetic, which the timings alone do not show.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from specjax import checks, sharding, timing, trees, verify
from specjax.decoding import MIN_BUCKET, bucket_length, cache_length
from specjax.drafters.oracle import Oracle
from specjax.lab.phases import profile_phases, round_loop
from specjax.models import decoder
from specjax.models.cache import KVCache
from specjax.rounds import commit_round
from specjax.sampling import GREEDY, SamplingConfig
from specjax.target import Target

# Each row's timed parts, in seconds (the order `bench_roofline` prints them in).
PARTS = ("forward", "lm_head", "dead_slots", "accept", "accept_sampled", "commit_chain",
         "commit_tree", "phase")


def per_iteration(body: Callable[[Any], Any], carry: Any, repeats: int, trials: int) -> float:
  """Seconds per iteration of `body: carry -> carry` run in a compiled `lax.fori_loop`: the
  fastest of `trials` runs of 2 * repeats iterations less the fastest of none, over 2 * repeats
  (`specjax.timing.per_iteration`)."""
  loop = jax.jit(lambda n, c: jax.lax.fori_loop(0, n, lambda _, c: body(c), c))
  runs = {"body": lambda n: jax.block_until_ready(loop(n, carry))}
  return timing.per_iteration(runs, 2 * repeats, trials)["body"][0]


def _live_cache(target: Target, slots: int, live: int) -> KVCache:
  cfg = target.config
  cache = decoder.init_cache(cfg, 1, slots)
  rs = np.random.RandomState(1)

  def fill(a):
    return jnp.asarray(rs.normal(size=a.shape).astype(np.float32), a.dtype)
  return cache.replace(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)),
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
  copies = decoder.copies_head(cfg, target.platform, t)  # as `generate` reads it
  head = decoder.head_kernel(cfg, target.params) if copies else None

  def body(c):
    cache, tokens, top = c
    positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    out = decoder.forward(cfg, target.params, tokens, positions, mask, cache, logits_index=index,
                          head_kernel=head)
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


def _commit_loop(cache: KVCache, t: int, chain: bool, repeats: int, trials: int) -> float:
  """Per-iteration seconds of the loop's commit of a whole block of T slots
  (`rounds.commit_round`): a chain's, or a tree's whose path is the whole block (the length is
  reset after each commit, so every iteration keeps the same slots)."""
  path = jnp.arange(t, dtype=jnp.int32)[None, :]
  n = jnp.full((1,), t, jnp.int32)

  def body(cache):
    return commit_round(cache, path, n, chain=chain).replace(length=cache.length)

  return per_iteration(body, cache, repeats, trials)


def _phase(target: Target, t: int, prompt_len: int, max_new: int, repeats: int,
           trials: int) -> float:
  """The loop's verify phase on a block of T: `profile_phases` with a chain of T - 1 nodes."""
  rs = np.random.RandomState(0)
  prompt = rs.randint(0, target.config.vocab_size, prompt_len).tolist()
  drafter = None if t == 1 else random_chain(target, t - 1, prompt_len, max_new, rs)
  return profile_phases(target, [prompt], drafter=drafter, max_new_tokens=max_new,
                        repeats=repeats, trials=trials)["t_verify"]


def random_chain(target: Target, num_tokens: int, prompt_len: int, max_new: int,
                 rs: np.random.RandomState) -> Oracle:
  """An oracle chain of `num_tokens` over a random continuation (drawn from `rs`) of a
  `prompt_len`-token prompt: a drafter of the chain's shapes, for timing and profiling, whose
  drafts the target mostly rejects (the costs of a round do not depend on what it accepts)."""
  reference = rs.randint(0, target.config.vocab_size, (1, max_new))
  return Oracle(jnp.asarray(reference, jnp.int32), jnp.asarray([prompt_len], jnp.int32),
                num_tokens=num_tokens)


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
           "commit_chain": _commit_loop(full, t, True, repeats, trials),
           "commit_tree": _commit_loop(full, t, False, repeats, trials),
           "phase": _phase(target, t, prompt_len, max_new, repeats, trials)}
    rows.append(row)
  base = next((r["phase"] for r in rows if r["t"] == 1), None)
  if base is None:
    base = _phase(target, 1, prompt_len, max_new, repeats, trials)
  for r in rows:
    r["ratio"] = r["phase"] / base
  return rows


# ------------------------------------------------------------------------------------------------
# Kernels: what a compiled round launches, by named scope

# The named scopes (`jax.named_scope`) of the decode loop's phases (the drafter's update after
# verification counts as one of its own), and of the parts of a forward (each decoder layer's
# attention and MLP sublayers, with their norms and residual adds) and of a verify phase, as
# the model, the drafters and the loop set them. A kernel is filed under the innermost phase
# and the innermost part in its HLO op_name ("other" where there is none).
PHASE_SCOPES = ("draft", "verify", "drafter_update")
PART_SCOPES = ("embed", "attention", "mlp", "lm_head", "accept", "commit",
               "correction")  # the last: DFlash's causal correction
# Instructions whose kernels run others inside them: their spans would count those twice.
_CONTROL_OPS = ("while", "conditional", "call")
_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s+=\s+.*?\s([a-z][\w-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([^\s,()]+)")


def hlo_scopes(hlo: str) -> dict[str, str]:
  """Instruction name -> its scope (`scope_of` its op_name) for every instruction of an
  optimized HLO text that is not control flow. An instruction that XLA rewrote without
  metadata takes the scope of its first operand that has one, else of a user. On CPU those are
  the one-row matmuls (XLA's GEMV rewrite drops their metadata): their first operand holds the
  activations, which the same sublayer computed, so they land in their own sublayer, except a
  drafter's LM head over the draft layer's raw output, which lands in that layer's `mlp`."""
  op_names = {}
  operands, users = collections.defaultdict(list), collections.defaultdict(list)
  for line in hlo.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None or m.group(2) in _CONTROL_OPS:
      continue
    name = m.group(1)
    op = _OP_NAME.search(line)
    op_names[name] = op.group(1) if op else None
    for operand in _OPERAND.findall(line[m.end():]):
      users[operand].append(name)
      operands[name].append(operand)
  scopes = {n: scope_of(op) for n, op in op_names.items() if op}
  for _ in range(4):  # a chain of unnamed instructions fills in over a few passes
    for name in op_names.keys() - scopes.keys():
      known = next((x for x in operands[name] + users[name] if x in scopes), None)
      if known is not None:
        scopes[name] = scopes[known]
  return {n: scopes.get(n, "other/other") for n in op_names}


def scope_of(op_name: str) -> str:
  """'phase/part' of a jax name stack such as `jit(f)/while/body/verify/mlp/dot_general`: the
  last of PHASE_SCOPES and the last of PART_SCOPES in it, each 'other' when absent."""
  parts = op_name.split("/")
  phase = next((p for p in reversed(parts) if p in PHASE_SCOPES), "other")
  part = next((p for p in reversed(parts) if p in PART_SCOPES), "other")
  return f"{phase}/{part}"


def _trace_events(run: Callable[[], Any]) -> list[dict]:
  """The complete ('X') events of a profiler trace of `run()`."""
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      run()
    paths = glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    if not paths:
      raise RuntimeError(f"the profiler wrote no trace under {folder}")
    with gzip.open(paths[0], "rt") as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  return [e for e in events if e.get("ph") == "X"]


def kernel_times(target: Target, prompts, *, drafter=None, rounds: int = 20, trials: int = 3,
                 max_new_tokens: int = 64, sampling: SamplingConfig = GREEDY,
                 pad_to: int | None = None) -> dict[str, dict[str, float]]:
  """Per round of `generate`'s loop (draft, then verify; `lab.phases.round_loop`), by scope
  ('phase/part', see `scope_of`): {"kernels": how many it launches, "seconds": their time},
  and "total" over all scopes.

  One profiler trace of `trials` runs of `rounds` (>= 2) rounds each. A kernel of the round
  launches at least once per round (more inside a loop of its own); those that launch less are
  left out: the call's own, the first draft, and a branch not taken in every round. A kernel's
  time is its median duration, which keeps the odd preempted launch out, times its launches
  per round. Kernels that run concurrently (XLA CPU runs independent ones on its threads) each
  count in full, and the profiler's own cost is in every launch, so the seconds can add up to
  more than the round's wall time: use them for where the time goes, and
  `lab.phases.profile_phases` for how long a round takes. On a mesh every device's kernels
  count (a part on 8 devices launches 8 times as many)."""
  rounds = checks.integer("rounds", rounds, lo=2)  # at 1, the first draft's kernels would count
  trials = checks.integer("trials", trials, lo=1)
  run, hlo = round_loop(target, prompts, drafter=drafter, max_new_tokens=max_new_tokens,
                        sampling=sampling, pad_to=pad_to)
  scopes = hlo_scopes(hlo)
  run(rounds)  # the first call loads the executable and warms the caches
  durations = collections.defaultdict(list)
  for e in _trace_events(lambda: [run(rounds) for _ in range(trials)]):
    if e.get("name") in scopes:
      durations[e["name"]].append(e.get("dur", 0.0) * 1e-6)  # microseconds
  per_round = trials * rounds
  out = collections.defaultdict(lambda: {"kernels": 0.0, "seconds": 0.0})
  for name, durs in durations.items():
    if len(durs) >= per_round:
      launches = len(durs) / per_round
      out[scopes[name]]["kernels"] += launches
      out[scopes[name]]["seconds"] += float(np.median(durs)) * launches
  out = dict(sorted(out.items(), key=lambda kv: -kv[1]["seconds"]))
  out["total"] = {name: sum(v[name] for v in out.values()) for name in ("kernels", "seconds")}
  return out


# -- The weight-streaming floor ------------------------------------------------------------------
# A batch-1 decode step multiplies one row of activations by every weight matrix, so it reads
# each weight once and does two flops per four bytes read (f32): on a CPU it is bound by how fast
# each core streams weights from memory, and no kernel or compiler choice brings a step below
# the bytes it must read over that rate.

_STREAM_ROWS = 256  # the GEMV's input width: the embedded target's hidden size


def step_read_bytes(target: Target) -> int:
  """Bytes of weights a device reads in one batch-1 decode step, on the device that reads most:
  every parameter's local shard once (`sharding.bytes_per_device`), except an untied input
  embedding, of which a step looks up one row (a tied one is read whole as the LM head). Bytes
  as the params are stored: a program that computes in a wider dtype may read converted copies
  (XLA hoists bfloat16 -> float32 converts out of the decode loop), so the floor they give is
  then looser."""
  held = sharding.bytes_per_device(target.params)
  if not target.config.tie_word_embeddings:
    for device, table in sharding.bytes_per_device(
        sharding.embedding_tables(target.params)).items():
      held[device] -= table
  return max(held.values())


def stream_bandwidth(mesh=None, *, nbytes: int = 64 << 20, repeats: int = 10,
                     trials: int = 3) -> float:
  """Bytes per second each device streams weights at while every device of `mesh` (one device
  when None) streams its own at once: a compiled loop of GEMVs, one row against an f32 matrix of
  about `nbytes` (far beyond the caches) whose columns lie over the devices, the read pattern of
  a decode step's matmuls, timed as a whole loop of `repeats` (the fastest of `trials`). The
  devices share the machine's memory, so this is the rate a sharded step gets, not what one
  device alone would."""
  nbytes = checks.integer("nbytes", nbytes, lo=4 * _STREAM_ROWS)
  repeats = checks.integer("repeats", repeats, lo=1)
  trials = checks.integer("trials", trials, lo=1)
  devices = 1 if mesh is None else mesh.size
  cols = max(1, nbytes // (4 * _STREAM_ROWS * devices)) * devices
  w = jnp.ones((_STREAM_ROWS, cols), jnp.float32)
  x = jnp.ones((1, _STREAM_ROWS), jnp.float32)
  if mesh is not None:
    w = jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, tuple(mesh.axis_names))))
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec()))

  def body(x, w):
    # Each iteration's input depends on the last product (one scalar all-reduce on a mesh), so
    # every GEMV stays in the loop and reads the whole matrix again.
    return x + 1e-30 * jnp.sum(x @ w)

  # The whole loop's wall time over its iterations, fastest of `trials` (not `per_iteration`'s
  # difference of two runs, which noise can make negative): each GEMV reads megabytes, so the
  # call's own cost is a small part of it and only makes the rate a little lower. The matrix is
  # an argument the loop reads, not part of its carry, which the call would copy out.
  loop = jax.jit(lambda x, w: jax.lax.fori_loop(0, repeats, lambda _, x: body(x, w), x))
  jax.block_until_ready(loop(x, w))
  seconds = min(timing.wall(lambda: jax.block_until_ready(loop(x, w))) for _ in range(trials))
  return int(w.nbytes) / devices / (seconds / repeats)
