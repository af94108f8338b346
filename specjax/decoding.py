"""`generate`: validates its inputs, pads them to a compiled program's shapes and runs it.

The program itself (the prompt pass and the loop of rounds, all inside one jit call) is
`specjax.rounds`; this module is its host side: inputs checked before anything compiles, the
shapes they pad to, the programs compiled once per shape and reused, and the result read back.

Shapes are static per bucket: prompt lengths and `max_new_tokens` are each padded up to a power of
two, or from 128 on to the next of the powers of two and their midpoints (192, 384, ...:
`bucket_lengths`), and the batch to a power of two (with rows that start finished), so a new
length or batch size inside a bucket reuses the compiled program. Sampling's temperature and
top-p are traced values (only greedy vs sampled, top-k and top-p on/off select programs), as is
`max_new_tokens` itself: a sweep over temperatures, top-p values or generation lengths compiles
once per bucket. The prefill runs in chunks (`rounds.PREFILL_CHUNK`), as many as the longest
prompt needs, so the padding of a bucket costs no prefill work past its last chunk.

On a device mesh (a target from `Target.on_mesh` or `load_target(mesh=...)`) the same program is
compiled with explicit shardings (`specjax.sharding`): params and drafter by the partition rules,
batch rows and the KV cache rows over `data` (the batch padded to a multiple of it with rows that
start finished), KV heads over `model`; the cache is allocated on its sharding and donated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from specjax import checks, metrics, rounds, sharding, verify
from specjax.children import TOP_K
from specjax.drafters.base import Drafter, NoDrafter, check_drafter, verify_sizes_of
from specjax.models import decoder
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.rounds import DecodeState, ProgramArgs, Spec
from specjax.sampling import SamplingConfig
from specjax.target import Target

MIN_BUCKET = 16
# From here on buckets also come at 1.5x a power of two: a long prompt (or generation) pads by at
# most half instead of doubling, in the prefill's work and in the cache slots every round attends
# to, at one more program per octave. Below it the programs are cheap to pad and a finer grid
# would only compile more of them.
FINE_BUCKETS = 128


@dataclasses.dataclass(frozen=True)
class Stats:
  tokens_per_second: float  # emitted tokens / wall time of the compiled call (compile excluded)
  tau: float  # emitted tokens / target forward passes, averaged over rows (AR: 1.0)
  target_calls: int  # target forward passes executed (prefill + rounds)
  drafter_calls: int  # draft() calls (rounds; 0 for autoregressive decoding)
  new_tokens: int  # emitted tokens summed over rows (after EOS / max_new_tokens truncation)
  accepted_by_depth: tuple[int, ...]  # [k] = row-rounds that accepted exactly k draft nodes
  wall_seconds: float
  compile_seconds: float  # 0.0 when the program came from the cache
  compiled: bool  # True when this call had to compile
  # Target forward passes each row took part in while it was still generating: a batch's rows
  # accept raggedly, so a row that finished early took fewer (batch 1: (target_calls,)).
  row_calls: tuple[int, ...] = ()
  # Rounds by the number of draft nodes verified, for a drafter that declares verify sizes
  # (`specjax.drafters.base.verify_sizes_of`): {n: rounds}; other drafters verify N every round.
  rounds_by_size: dict[int, int] = dataclasses.field(default_factory=dict)

  @property
  def acceptance_by_depth(self) -> tuple[float, ...]:
    """alpha_d = P(a depth-d node is accepted | its parent was), d = 1..N (the field's metric)."""
    return tuple(metrics.acceptance_by_depth(self.accepted_by_depth, unreached=float("nan")))


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  tokens: list[list[int]]  # new tokens per row, prompt excluded, EOS included when hit
  stats: Stats
  text: list[str] | None = None  # decoded tokens when the target has a tokenizer
  drafter_state: Any = None  # the drafter's final state (e.g. Token Recycling's table)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A call's program inputs: its static spec, its arguments (placed on the target's mesh when
  it has one) and how many of their rows are real (the rest are padding, done from the start)."""

  spec: Spec
  args: ProgramArgs
  real_rows: int

  @property
  def rows(self) -> int:
    return self.args.prompts.shape[0]

  def fresh_cache(self) -> KVCache:
    """A zeroed cache for one call (the program takes it over)."""
    return init_cache(self.spec, self.rows)


def bucket_lengths(limit: int) -> list[int]:
  """The bucket lengths up to `limit`: powers of two from MIN_BUCKET, and from FINE_BUCKETS on
  the midpoints between them (192, 384, 768, ...)."""
  out, b = [], MIN_BUCKET
  while b < limit:
    out.append(b)
    if b >= FINE_BUCKETS:
      out.append(b * 3 // 2)
    b *= 2
  return [x for x in out if x < limit] + [limit]


def bucket_length(n: int, limit: int) -> int:
  """The smallest bucket >= n (`bucket_lengths`), capped at `limit` (n itself when longer)."""
  return max(next(b for b in bucket_lengths(limit) if b >= min(n, limit)), n)


def cache_length(prompt_bucket: int, max_new_tokens: int, num_nodes: int, limit: int) -> int:
  """The KV cache (and history) length of a program: the padded prompt, `max_new_tokens` up to
  its bucket, and one last round's whole block (the pending token and the tree's nodes). Nodes
  past the context only ever produce tokens past max_new_tokens, which are cut: a tree never
  needs to shrink near the end of the context."""
  return prompt_bucket + bucket_length(max_new_tokens, limit) + num_nodes + 1


def batch_rows(batch: int, mesh=None) -> int:
  """The rows a program of `batch` prompts runs: a power of two, then a multiple of the mesh's
  data axis; the extra rows start finished."""
  return sharding.padded_batch(1 << (batch - 1).bit_length(), mesh)


def init_cache(spec: Spec, batch: int) -> KVCache:
  """The target's zeroed cache, allocated directly on its sharding."""
  return _cache_allocator(spec.config, spec.cache_len, spec.mesh, batch)()


@functools.lru_cache(maxsize=64)
def _cache_allocator(cfg: ModelConfig, cache_len: int, mesh, batch: int):
  """One jitted allocator per cache shape and mesh (a new jit per call would recompile)."""
  def init():
    return decoder.init_cache(cfg, batch, cache_len)
  if mesh is None:
    return jax.jit(init)
  return jax.jit(init, out_shardings=rounds.cache_layout(cfg, mesh))


# ------------------------------------------------------------------------------------------------
# Compiled programs


_COMPILED: dict[tuple, jax.stages.Compiled] = {}


def release_compiled() -> None:
  """Drops every compiled program (`generate`'s and jax's caches). A long job that compiles
  hundreds of programs (a test session, `experiments.reproduce all`) releases them between its
  parts: each executable holds mapped code sections, and a process runs out of mappings (LLVM's
  "Unable to allocate section memory") long before it runs out of memory."""
  _COMPILED.clear()
  jax.clear_caches()


def mesh_context(mesh):
  """Traces under `jax.set_mesh(mesh)` so mesh-aware code (the Pallas attention's shard_map)
  sees the mesh; a no-op on one device."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def compiled(spec: Spec, args: ProgramArgs, cache: KVCache
             ) -> tuple[jax.stages.Compiled, float]:
  """`rounds.generate_program` AOT-compiled once per (spec, argument structure, shapes), called as
  `program(args, cache)`; returns it and the compile time (0.0 when it was compiled before).

  On a mesh the program's in_shardings are its arguments' (placed by `prepare`) and its
  out_shardings the loop state's layout; the cache argument is donated either way."""
  leaves, treedef = jax.tree.flatten((args, cache))
  key = (spec, treedef) + tuple((a.shape, a.dtype) for a in leaves)
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  begin = time.perf_counter()
  placed = {}
  if spec.mesh is not None:
    placed = dict(in_shardings=jax.tree.map(lambda a: a.sharding, (args, cache)),
                  out_shardings=rounds.state_shardings(spec))
  fn = jax.jit(rounds.generate_program, static_argnums=0, donate_argnums=2, **placed)
  with mesh_context(spec.mesh):
    _COMPILED[key] = fn.lower(spec, args, cache).compile()
  return _COMPILED[key], time.perf_counter() - begin


# ------------------------------------------------------------------------------------------------
# Inputs


SEED_LIMIT = 2**32  # jax.random.key reads a seed modulo 2**32: larger ones would alias


def _is_single_prompt(prompts) -> bool:
  if isinstance(prompts, str):
    return True
  if isinstance(prompts, (np.ndarray, jax.Array)):
    return prompts.ndim == 1
  return len(prompts) > 0 and checks.is_int(prompts[0])


def _token_ids(target: Target, i: int, prompt) -> list[int]:
  """Prompt i as token ids: text is encoded, ids must be ints (numpy ones included)."""
  if isinstance(prompt, str):
    return target.encode(prompt)
  if isinstance(prompt, (bytes, bytearray)):
    raise ValueError(f"prompt {i} is bytes: decode it to text (str) first, or pass token ids")
  if isinstance(prompt, (np.ndarray, jax.Array)):
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"prompt {i} must be a 1-D integer array of token ids, got dtype "
                       f"{prompt.dtype} and shape {prompt.shape}")
    return np.asarray(prompt).tolist()
  if not isinstance(prompt, Sequence):
    raise ValueError(f"prompt {i} must be a string or a sequence of int token ids, got "
                     f"{prompt!r} ({type(prompt).__name__})")
  for j, t in enumerate(prompt):
    if not checks.is_int(t):
      raise ValueError(f"prompt {i} token {j} is {t!r} ({type(t).__name__}): token ids must be "
                       "ints")
  return [int(t) for t in prompt]


def _prepare_prompts(target: Target, prompts) -> list[list[int]]:
  if not isinstance(prompts, (Sequence, np.ndarray, jax.Array)):
    raise ValueError(f"prompts must be a list of prompts (strings or token-id lists), got "
                     f"{type(prompts).__name__}")
  if isinstance(prompts, (bytes, bytearray)):
    raise ValueError("prompts is bytes: decode it to text (str) and pass a list of prompts")
  if _is_single_prompt(prompts):
    raise ValueError("prompts must be a list of prompts (strings or token-id lists), "
                     "not a single prompt")
  ids = [_token_ids(target, i, p) for i, p in enumerate(prompts)]
  if not ids:
    raise ValueError("no prompts given")
  vocab = target.config.vocab_size
  for i, row in enumerate(ids):
    if not row:
      raise ValueError(f"prompt {i} is empty")
    bad = [t for t in row if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
  return ids


def _eos_array(cfg: ModelConfig, eos_token_id) -> np.ndarray:
  """eos_token_id: None (the config's), an int, or a sequence of ints ([]: no EOS stop)."""
  if eos_token_id is None:
    eos = list(cfg.eos_token_id)
  elif checks.is_int(eos_token_id):
    eos = [eos_token_id]
  elif isinstance(eos_token_id, (Sequence, np.ndarray)) and not isinstance(
      eos_token_id, (str, bytes)):
    eos = list(eos_token_id)
  else:
    eos = [eos_token_id]
  for e in eos:
    if not checks.is_int(e):
      raise ValueError(f"eos_token_id must be an int, a sequence of ints, or None / [], got "
                       f"{e!r} ({type(e).__name__})")
    if not 0 <= e < cfg.vocab_size:
      raise ValueError(f"eos_token_id {e} outside the vocabulary [0, {cfg.vocab_size})")
  return np.asarray(eos or [-1], np.int32)  # -1 never matches a token: no EOS stop



def children_used(drafter: Drafter, sampling: SamplingConfig) -> str:
  """How `drafter` picks children in a run at `sampling`: "top_k" (deterministic; always at
  temperature 0), "iid" or "wor" (`specjax.children`)."""
  return getattr(drafter, "children", TOP_K).used(sampling)


def check_rule(drafter: Drafter, sampling: SamplingConfig, rule: verify.Rule) -> None:
  """ValueError when `rule` cannot verify the trees `drafter` drafts at `sampling`
  (`verify.check_children`); at temperature 0, or without a drafter, every rule can."""
  if drafter.num_nodes and not sampling.greedy:
    verify.check_children(rule, children_used(drafter, sampling),
                          getattr(drafter, "counts_fixed", True))


def prepare(target: Target, prompts, max_new_tokens: int, drafter: Drafter,
            sampling: SamplingConfig, seed: int = 0, eos_token_id=None,
            pad_to: int | None = None, rule: verify.Rule | str | None = None) -> Prepared:
  """Validates a call's inputs and builds its program's spec and arguments (`Prepared`)."""
  cfg = target.config
  rule = verify.rule_of(rule)
  max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=1)
  seed = checks.integer("seed", seed)
  if not 0 <= seed < SEED_LIMIT:
    raise ValueError(f"seed must be an int in [0, 2**32), got {seed}")
  check_drafter(drafter, cfg)
  check_rule(drafter, sampling, rule)
  if not drafter.num_nodes:  # nothing to accept: one program whatever the rule
    rule = verify.RECURSIVE
  elif not sampling.greedy:  # where the rule decides what is emitted
    verify.warn_if_lossy(rule, stacklevel=4)
  ids = _prepare_prompts(target, prompts)
  longest = max(len(r) for r in ids)
  cfg.check_window(longest + max_new_tokens,
                   f"prompt length {longest} + max_new_tokens {max_new_tokens}")
  if longest + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the "
                     f"model's context of {cfg.max_position_embeddings} tokens")
  if pad_to is not None:
    pad_to = checks.integer("pad_to", pad_to, lo=1)
    if pad_to < longest:
      raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest})")
    if pad_to > cfg.max_position_embeddings:  # padding is allocated: never past the context
      raise ValueError(f"pad_to={pad_to} exceeds the model's context of "
                       f"{cfg.max_position_embeddings} tokens")
  p = pad_to or bucket_length(longest, cfg.max_position_embeddings)
  mesh = target.mesh
  copied = sharding.replicates_drafter(drafter, target.params, mesh)
  spec = Spec(cfg, mesh=mesh, cache_len=cache_length(
      p, max_new_tokens, drafter.num_nodes, cfg.max_position_embeddings), copied_drafter=copied,
      head_copy=decoder.copies_head(cfg, target.platform, drafter.num_nodes + 1), rule=rule)
  n_real = len(ids)
  rows = ids + [ids[-1]] * (batch_rows(n_real, mesh) - n_real)  # pad rows: done
  prompt_arr = np.zeros((len(rows), p), np.int32)
  for i, row in enumerate(rows):
    prompt_arr[i, :len(row)] = row
  args = ProgramArgs(
      params=target.params, drafter=drafter, prompts=prompt_arr,
      prompt_lens=np.asarray([len(r) for r in rows], np.int32),
      live=np.arange(len(rows)) < n_real, eos_ids=_eos_array(cfg, eos_token_id),
      rng=jax.random.key(seed),
      sampling=jax.tree.map(lambda x: np.asarray(x, np.float32), sampling),
      max_new=np.asarray(max_new_tokens, np.int32))
  placed = _on_device(args) if mesh is None else _on_mesh(args, target, mesh, copied)
  return Prepared(spec, placed, n_real)


def _on_device(args: ProgramArgs) -> ProgramArgs:
  """The host arrays of `args` on the default device (params, drafter and key are already)."""
  host = ("prompts", "prompt_lens", "live", "eos_ids", "sampling", "max_new")
  return args.replace(**{f: jax.tree.map(jnp.asarray, getattr(args, f)) for f in host})


def _on_mesh(args: ProgramArgs, target: Target, mesh, copied: bool) -> ProgramArgs:
  """`args` laid out on `mesh`: rows over data, the rest replicated, the drafter by its rules."""
  def place(a: np.ndarray, where: jax.sharding.NamedSharding) -> jax.Array:
    # `a` (the same value on every process) laid out by `where`, each process placing only its
    # own devices' slices: unlike device_put, no cross-process check that the values agree, and
    # it works when the mesh spans other processes' devices.
    return jax.make_array_from_callback(a.shape, where, lambda index: a[index])

  rows, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  # A key array is not a plain array that device_put can spread over other processes' devices:
  # its raw data is placed instead and wrapped again.
  key_data = place(np.asarray(jax.random.key_data(args.rng)), rep)
  return args.replace(
      drafter=sharding.place_drafter(args.drafter, target, mesh, copied=copied),
      prompts=place(args.prompts, rows), prompt_lens=place(args.prompt_lens, rows),
      live=place(args.live, rows), eos_ids=place(args.eos_ids, rep),
      rng=jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(args.rng)),
      sampling=jax.tree.map(lambda a: place(a, rep), args.sampling),
      max_new=place(args.max_new, rep))


# ------------------------------------------------------------------------------------------------
# generate


def generate(target: Target, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             drafter: Drafter | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_token_id: int | Sequence[int] | None = None,
             pad_to: int | None = None, mesh=None, rule: verify.Rule | str | None = None
             ) -> GenerateResult:
  """Generates up to `max_new_tokens` per prompt in one jit call, speculatively with `drafter`.

  prompts: strings (encoded with the target's tokenizer) or lists of token ids; rows may differ
  in length. drafter: None for autoregressive decoding, or one from `specjax.drafters.build`.
  The output is the target's whatever the drafter: greedy tokens identical to autoregressive
  decoding, sampled tokens with exactly the target's distribution (temperature, top-k, top-p).
  eos_token_id: ids that stop a row (default: the config's; [] disables). A row stops at its
  first EOS (kept in the output) or after exactly `max_new_tokens` tokens.
  pad_to: pad prompts to this many tokens instead of their bucket (one program for a whole
  benchmark set). seed: an int in [0, 2**32) (jax would alias larger ones).
  mesh: run on this device mesh (a Mesh or a spec such as 'dp=2,tp=4'; default: the target's
  own, `Target.on_mesh`); the output is the same on every mesh.
  rule: how drafts are accepted at temperatures > 0 (`specjax.verify.Rule` or its name:
  "recursive", the default; "kseq", SpecTr's selection, for drafters with children='iid'
  whose trees are not pruned by their draws (`verify.check_children`); "typical", Medusa's
  typical acceptance, which is LOSSY and warns).
  Raises ValueError for a bad argument (before compiling), for a drafter built for another
  target, and after the run when the target's logits are not finite.
  """
  drafter = NoDrafter() if drafter is None else drafter
  if mesh is not None:
    target = target.on_mesh(mesh)
  run = prepare(target, prompts, max_new_tokens, drafter,
                SamplingConfig(temperature, top_k, top_p), seed, eos_token_id, pad_to, rule)
  cache = run.fresh_cache()
  program, compile_seconds = compiled(run.spec, run.args, cache)
  eos = to_host(run.args.eos_ids)
  begin = time.perf_counter()
  state = jax.block_until_ready(program(run.args, cache))
  wall = time.perf_counter() - begin
  _check_finite(state)
  tokens = _collect(state, eos, max_new_tokens)[:run.real_rows]
  calls = to_host(state.calls)[:run.real_rows]
  n_new = sum(len(t) for t in tokens)
  n_rounds = int(to_host(state.rounds))
  stats = Stats(
      tokens_per_second=n_new / wall if wall > 0 else float("inf"),
      tau=float(np.mean([metrics.tau(len(t), c) for t, c in zip(tokens, calls)])),
      target_calls=n_rounds + 1,
      drafter_calls=n_rounds if drafter.num_nodes else 0,
      new_tokens=n_new,
      accepted_by_depth=tuple(int(x) for x in to_host(state.accepted_hist)),
      wall_seconds=wall,
      compile_seconds=compile_seconds,
      compiled=compile_seconds > 0,
      row_calls=tuple(int(c) for c in calls),
      rounds_by_size=_rounds_by_size(drafter, state),
  )
  text = [target.decode(t) for t in tokens] if target.tokenizer is not None else None
  return GenerateResult(tokens, stats, text, state.drafter_state)


def to_host(x: jax.Array) -> np.ndarray:
  """The whole of a (possibly multi-process) array as numpy, on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _check_finite(state: DecodeState) -> None:
  """The prefill's logits are checked in the program (one reduction): NaN weights would
  otherwise decode as token 0 without a word."""
  bad = np.flatnonzero(~to_host(state.finite))
  if bad.size:
    raise ValueError(f"the target's logits are not finite (NaN/inf weights?) for prompt "
                     f"{int(bad[0])}")

def _rounds_by_size(drafter: Drafter, state: DecodeState) -> dict[int, int]:
  """{n: rounds verified at n nodes} for a drafter with more than one verify size, else {}."""
  sizes = verify_sizes_of(drafter)
  if len(sizes) == 1:
    return {}
  return {n: int(k) for n, k in zip(sizes, to_host(state.size_hist))}


def _collect(state: DecodeState, eos_ids: np.ndarray, max_new_tokens: int) -> list[list[int]]:
  history, hist_len = to_host(state.history), to_host(state.hist_len)
  rows = []
  for row, start, end in zip(history, to_host(state.prompt_len), hist_len):
    row = row[start:min(end, start + max_new_tokens)].tolist()
    for i, t in enumerate(row):
      if t in eos_ids:
        row = row[:i + 1]
        break
    rows.append(row)
  return rows
