"""`generate`: prefill plus one `lax.while_loop` of rounds, all inside a single jit call.

Conventions (the field's):
  * the cache holds every emitted token except the last one, `pending`, whose KV is written by
    the next round: a round feeds `[pending | draft tree]`, so autoregressive decoding is the round
    with an empty tree;
  * a round emits the accepted draft tokens plus one bonus token sampled from the target;
  * `target_calls` counts target forward passes (prefill included), so AR has tau = 1.0 exactly.

Shapes are static per bucket: prompt lengths and `max_new_tokens` are each padded up to a power of
two, or from 128 on to the next of the powers of two and their midpoints (192, 384, ...:
`bucket_lengths`), and the batch to a power of two (with rows that start finished), so a new
length or batch size inside a bucket reuses the compiled program. Sampling's temperature and
top-p are traced values (only greedy vs sampled, top-k and top-p on/off select programs), as is
`max_new_tokens` itself: a sweep over temperatures, top-p values or generation lengths compiles
once per bucket. The prefill runs in chunks (`PREFILL_CHUNK`), as many as the longest prompt
needs, so the padding of a bucket costs no prefill work past its last chunk.

On a device mesh (a target from `Target.on_mesh` or `load_target(mesh=...)`) the same program is
compiled with explicit shardings (`specjax.sharding`): params and drafter by the partition rules,
batch rows and the KV cache rows over `data` (the batch padded to a multiple of it with rows that
start finished), KV heads over `model`; the cache is allocated on its sharding and donated.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

from specjax import checks, metrics, sharding, timing, trees, verify
from specjax.drafters.base import (
    DraftContext,
    Drafter,
    NoDrafter,
    Prefill,
    RoundResult,
    TargetView,
    check_drafter,
    verify_sizes_of,
)
from specjax.models import decoder
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingConfig, row_keys, sample
from specjax.target import Target

MIN_BUCKET = 16
# From here on buckets also come at 1.5x a power of two: a long prompt (or generation) pads by at
# most half instead of doubling, in the prefill's work and in the cache slots every round attends
# to, at one more program per octave. Below it the programs are cheap to pad and a finer grid
# would only compile more of them.
FINE_BUCKETS = 128
# The prefill runs in chunks of this many prompt positions, as many as the longest prompt needs: a
# prompt padded to its bucket (or to a whole benchmark set's) costs its own length rounded up to a
# chunk, not the bucket. Buckets from 64 on are multiples of it; a shorter or odd `pad_to` is one
# chunk.
PREFILL_CHUNK = 64


@struct.dataclass
class DecodeState:
  """Everything the loop carries; a rejected draft is just a length that did not advance."""

  cache: KVCache
  history: jax.Array  # int32[B, W]  prompt then emitted tokens; the last one is `pending`
  hist_len: jax.Array  # int32[B]
  prompt_len: jax.Array  # int32[B]
  done: jax.Array  # bool[B]        row hit EOS or max_new_tokens
  calls: jax.Array  # int32[B]      target forward passes that served this row
  rounds: jax.Array  # int32[]      loop iterations (target forward passes after prefill)
  accepted_hist: jax.Array  # int32[N+1]  rounds (of live rows) that accepted k draft nodes
  size_hist: jax.Array  # int32[Z]  rounds verified at each of the drafter's Z verify sizes
  rng: jax.Array
  drafter_state: Any
  finite: jax.Array  # bool[B]  the target's prefill logits were finite (False: NaN/inf weights)
  sampling: SamplingConfig  # this call's: temperature and top-p are traced
  max_new: jax.Array  # int32[]  this call's max_new_tokens (the cache holds its bucket)

  @property
  def pending(self) -> jax.Array:
    return jnp.take_along_axis(self.history, (self.hist_len - 1)[:, None], axis=1)[:, 0]

  @property
  def n_out(self) -> jax.Array:
    return self.hist_len - self.prompt_len


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
class _Spec:
  """The static part of a compiled generate program (its cache key with the array shapes)."""

  config: ModelConfig  # the sampling mode is in the sampling argument's tree structure
  cache_len: int
  mesh: jax.sharding.Mesh | None = None
  # The drafter is copied whole onto every device (`sharding.replicates_drafter`) and reads a
  # whole copy of the target's embedding table.
  copied_drafter: bool = False
  # The target's forwards read the LM head from a copy laid out [E, V] (`decoder.copies_head`).
  head_copy: bool = False


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


def _is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def _init_cache(spec: _Spec, batch: int) -> KVCache:
  """The target's zeroed cache, allocated directly on its sharding."""
  return _cache_allocator(spec.config, spec.cache_len, spec.mesh, batch)()


@functools.lru_cache(maxsize=64)
def _cache_allocator(cfg: ModelConfig, cache_len: int, mesh, batch: int):
  """One jitted allocator per cache shape and mesh (a new jit per call would recompile)."""
  def init():
    return decoder.init_cache(cfg, batch, cache_len)
  if mesh is None:
    return jax.jit(init)
  return jax.jit(init, out_shardings=_cache_layout(cfg, mesh))


def _cache_layout(cfg: ModelConfig, mesh) -> KVCache:
  kv = (jax.sharding.NamedSharding(mesh, sharding.cache_spec(cfg, mesh)),) * cfg.num_layers
  return KVCache(k=kv, v=kv, length=sharding.batch_sharding(mesh))


def _state_shardings(spec: _Spec) -> DecodeState:
  """The loop state's layout: rows over data, counters replicated; the drafter's state and the
  sampling values are left to the partitioner (None), which propagates them from the arrays they
  are computed from."""
  rows, rep = sharding.batch_sharding(spec.mesh), sharding.replicated(spec.mesh)
  return DecodeState(cache=_cache_layout(spec.config, spec.mesh), history=rows, hist_len=rows,
                     prompt_len=rows, done=rows, calls=rows, rounds=rep, accepted_hist=rep,
                     size_hist=rep,
                     rng=rep, drafter_state=None, finite=rows, sampling=None, max_new=rep)


def _constrain(spec: _Spec, state: DecodeState) -> DecodeState:
  """Pins the loop carry to `_state_shardings` (the drafter state and sampling values excepted)
  on a mesh."""
  if spec.mesh is None:
    return state
  layout = _state_shardings(spec)
  fixed = state.replace(drafter_state=None, sampling=None)
  fixed = jax.lax.with_sharding_constraint(fixed, layout)
  return fixed.replace(drafter_state=state.drafter_state, sampling=state.sampling)


def _head_kernel(spec: _Spec, params) -> jax.Array | None:
  """The LM head weight a program's verifications use (`decoder.head_kernel`, None for the
  model's own): made once, before its loop of rounds. The prompt pass keeps the model's own (its
  logits are one row per chunk)."""
  return decoder.head_kernel(spec.config, params) if spec.head_copy else None


def _drafter_params(spec: _Spec, params):
  """The target params a drafter reads: beside a copied drafter, with a whole copy of the
  embedding table on every device (`sharding.with_whole_embedding`). Programs call it once,
  outside their loops (generate's, after its prompt loop: `_prefill`)."""
  return sharding.with_whole_embedding(params) if spec.copied_drafter else params


def prefill_chunks(prompt_len: int, padded_len: int) -> int:
  """How many forward passes the prefill of a prompt of `prompt_len` tokens padded to
  `padded_len` runs (`_prompt_pass`; a batch runs as many as its longest prompt needs)."""
  c = PREFILL_CHUNK
  return -(-prompt_len // c) if padded_len > c and padded_len % c == 0 else 1


@jax.named_scope("prefill")
def _prompt_pass(cfg: ModelConfig, params, prompts, prompt_lens, cache: KVCache,
                 hidden_layers: tuple[int, ...]):
  """The prompts' forward into `cache` (its length left at 0): the logits at each row's last
  prompt token [B, V], the requested hidden states of every prompt position [H, B, P, E] (or
  None) and the cache holding the prompts' K/V at slots [0, P).

  In chunks of PREFILL_CHUNK positions when P is a multiple of it, in a loop of as many chunks
  as the longest prompt needs: chunk i attends to the slots before it through the cache (as a
  verification attends to the committed prefix) and causally within itself. Slots and hidden
  states past the last chunk are left as they were (zeros), past every row's prompt."""
  b, p = prompts.shape
  c = PREFILL_CHUNK
  if prefill_chunks(p, p) == 1:
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = decoder.forward(cfg, params, prompts, positions, decoder.causal_mask(prompt_lens, p),
                          cache, hidden_layers=hidden_layers,
                          logits_index=(prompt_lens - 1)[:, None])
    return out.logits[:, 0], out.hidden, out.cache
  causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]

  def chunk_pass(start, cache):
    pos = start + jnp.arange(c, dtype=jnp.int32)
    new_mask = causal[None] & (pos[None, None, :] < prompt_lens[:, None, None])
    at = jnp.clip(prompt_lens - 1 - start, 0, c - 1)[:, None]  # its logits' row (`chunk`)
    tokens = jax.lax.dynamic_slice_in_dim(prompts, start, c, axis=1)
    return decoder.forward(cfg, params, tokens, jnp.broadcast_to(pos, (b, c)), new_mask,
                           cache.replace(length=jnp.full((b,), start, jnp.int32)),
                           hidden_layers=hidden_layers, logits_index=at)

  def chunk(i, carry):
    last, hidden, cache = carry
    start = i * c
    out = chunk_pass(start, cache)
    offset = prompt_lens - 1 - start  # each row's last prompt token, if in this chunk
    last = jnp.where(((offset >= 0) & (offset < c))[:, None], out.logits[:, 0], last)
    if hidden is not None:
      hidden = jax.lax.dynamic_update_slice_in_dim(hidden, out.hidden, start, axis=2)
    return last, hidden, out.cache

  # The carry's dtypes are the forward's own (logits and hidden states in the compute dtype).
  shapes = jax.eval_shape(chunk_pass, 0, cache)
  last = jnp.zeros((b, cfg.vocab_size), shapes.logits.dtype)
  hidden = None
  if hidden_layers:
    hidden = jnp.zeros((len(hidden_layers), b, p, cfg.hidden_size), shapes.hidden.dtype)
  n_chunks = (jnp.max(prompt_lens) + c - 1) // c
  last, hidden, cache = jax.lax.fori_loop(0, n_chunks, chunk, (last, hidden, cache))
  return last, hidden, cache.replace(length=jnp.zeros((b,), jnp.int32))


def _prefill(spec: _Spec, params, drafter, prompts, prompt_lens, live, eos_ids, rng,
             sampling: SamplingConfig, max_new, cache: KVCache,
             decode: Callable[[Any, DecodeState], DecodeState] | None = None) -> DecodeState:
  """The prompts' forward pass into `cache`, then the drafter's `init`: the state the loop of
  rounds starts from (what tests decode from by hand); rows with `live` False (batch padding)
  start done. `decode(dparams, state)`, when given (`generate`'s loop of rounds), runs on from
  that state unless every row is done already; `dparams` are the target params as the drafter
  reads them.

  On a mesh, every loop or branch of the program that communicates is ordered by data against
  every other collective in it: XLA's CPU runtime runs independent operations at the same time,
  and two devices that enter two collectives in opposite orders wait for each other forever
  (`specjax.hlo.races` finds such pairs; the tests check every method's program). So everything
  after the prompt loop runs in one branch taken on the first tokens the loop gives: the whole
  embedding table a copied drafter reads (gathered there), the history, the drafter's `init`
  and `decode` with what XLA hoists out of its loop."""
  cfg = spec.config
  b, p = prompts.shape
  last, hidden, cache = _prompt_pass(cfg, params, prompts, prompt_lens, cache,
                                     drafter.hidden_layers)
  rng, key, _ = jax.random.split(rng, 3)
  first = jax.vmap(lambda k, x: sample(k, x, sampling))(row_keys(key, b), last)
  # A row whose logits are not finite stops at once (`generate` raises for it).
  finite = jnp.all(jnp.isfinite(last), axis=-1) | ~live
  done = _is_eos(first, eos_ids) | (max_new <= 1) | ~live | ~finite

  def start(go_on: bool) -> DecodeState:
    history = jnp.zeros((b, spec.cache_len), jnp.int32).at[:, :p].set(prompts)
    history = history.at[jnp.arange(b), prompt_lens].set(first)
    prefilled = cache.advance(prompt_lens)
    dparams = _drafter_params(spec, params)
    drafter_state = drafter.init(TargetView(cfg, sampling, dparams), Prefill(
        prompts, history, prompt_lens + 1, last, hidden, prefilled))
    state = _constrain(spec, DecodeState(
        cache=prefilled, history=history, hist_len=prompt_lens + 1, prompt_len=prompt_lens,
        done=done, calls=jnp.ones((b,), jnp.int32), rounds=jnp.zeros((), jnp.int32),
        accepted_hist=jnp.zeros((drafter.num_nodes + 1,), jnp.int32),
        size_hist=jnp.zeros((len(verify_sizes_of(drafter)),), jnp.int32), rng=rng,
        drafter_state=drafter_state, finite=finite, sampling=sampling, max_new=max_new))
    return decode(dparams, state) if go_on else state

  if decode is None:
    return start(False)
  return jax.lax.cond(jnp.all(done), lambda: start(False), lambda: start(True))


@jax.named_scope("draft")
def _draft_phase(spec: _Spec, dparams, drafter, s: DecodeState):
  """`dparams`: the target params as the drafter reads them (`_drafter_params`)."""
  rng, draft_key, accept_key = jax.random.split(s.rng, 3)
  view = TargetView(spec.config, s.sampling, dparams)
  tree, drafter_state, cache = drafter.draft(
      view, s.drafter_state, DraftContext(s.history, s.hist_len, s.pending, s.cache, draft_key))
  return tree, s.replace(cache=cache, drafter_state=drafter_state, rng=rng), accept_key


def _size_index(sizes: tuple[int, ...], tree: trees.Tree, live: jax.Array) -> jax.Array:
  """int32[]: the index of the smallest of `sizes` that holds every live row's last valid node
  (the last size, N, holds them all)."""
  if len(sizes) == 1:
    return jnp.zeros((), jnp.int32)
  node = jnp.arange(1, tree.num_nodes + 1, dtype=jnp.int32)
  need = jnp.max(jnp.where(tree.valid & live[:, None], node, 0))
  return jnp.sum(need > jnp.asarray(sizes[:-1], jnp.int32)).astype(jnp.int32)


@jax.named_scope("verify")
def _verify_phase(spec: _Spec, params, dparams, drafter, eos_ids, tree, s: DecodeState,
                  accept_key, size: jax.Array | None = None,
                  head_kernel: jax.Array | None = None) -> DecodeState:
  """Verify the tree in one target call, at the smallest of the drafter's verify sizes that
  holds its valid nodes (`size`: an index into those sizes instead, the profiler's choice).
  `head_kernel`: the target's LM head weight (`_head_kernel`), None for the model's own.

  More than one size: one `lax.cond` per size, in a row, whose other branch passes the state
  through; a round runs one verification. (A `lax.switch` over the sizes, or any conditional
  with more than one branch writing the cache, makes XLA copy the whole cache in every round.)
  """
  sizes = verify_sizes_of(drafter)
  if size is None:
    size = _size_index(sizes, tree, ~s.done)
  s = s.replace(size_hist=s.size_hist.at[size].add(1))
  if len(sizes) == 1:
    return _verify_nodes(spec, params, dparams, drafter, eos_ids, tree, s, accept_key=accept_key,
                         head_kernel=head_kernel)
  for i, n in enumerate(sizes):
    s = jax.lax.cond(size == i, functools.partial(
        _verify_nodes, spec, params, dparams, drafter, eos_ids, tree.head(n),
        accept_key=accept_key, head_kernel=head_kernel), lambda state: state, s)
  return s


def _verify_nodes(spec: _Spec, params, dparams, drafter, eos_ids, tree, s: DecodeState, *,
                  accept_key, head_kernel: jax.Array | None = None) -> DecodeState:
  """Verify [pending | tree] in one target call, accept, commit, append, update the drafter."""
  cfg = spec.config
  b = s.hist_len.shape[0]
  block = jnp.concatenate([s.pending[:, None], tree.tokens], axis=1)  # [B, N+1]
  positions = s.cache.length[:, None] + trees.positions_offsets(tree)
  out = decoder.forward(cfg, params, block, positions, trees.verify_mask(tree), s.cache,
                        hidden_layers=drafter.hidden_layers, head_kernel=head_kernel)
  with jax.named_scope("accept"):
    acc = verify.accept(tree, out.logits, s.sampling, accept_key)

  live = ~s.done
  n_emit = jnp.where(live, acc.n_accepted + 1, 0)  # accepted nodes + the bonus token
  idx = jnp.arange(block.shape[1])[None, :]
  # Emitted tokens go after the history; a finished row writes out of bounds (dropped).
  cols = jnp.where(idx < n_emit[:, None], s.hist_len[:, None] + idx, s.history.shape[1])
  history = s.history.at[jnp.arange(b)[:, None], cols].set(acc.tokens, mode="drop")
  hist_len = s.hist_len + n_emit
  emitted_eos = jnp.any(_is_eos(acc.tokens, eos_ids) & (idx < n_emit[:, None]), axis=1)
  view = TargetView(cfg, s.sampling, dparams)
  with jax.named_scope("drafter_update"):
    drafter_state = drafter.update(view, s.drafter_state, RoundResult(
        tree, acc, block, out.logits, out.hidden, live, history, hist_len))
  depth_bin = jnp.where(live, acc.n_accepted, drafter.num_nodes + 1)  # dead rows: dropped
  cache = commit_round(out.cache, acc.path, n_emit, chain=tree.chain)
  return s.replace(
      cache=cache,
      history=history, hist_len=hist_len,
      done=s.done | emitted_eos | (hist_len - s.prompt_len >= s.max_new),
      calls=s.calls + live, rounds=s.rounds + 1,
      accepted_hist=s.accepted_hist.at[depth_bin].add(1, mode="drop"),
      drafter_state=drafter_state)


@jax.named_scope("commit")
def commit_round(cache: KVCache, path: jax.Array, n_emit: jax.Array, *, chain: bool) -> KVCache:
  """The cache after a verified round keeps the root and its accepted nodes: `path` [B, T] (the
  block indices of the root and the accepted nodes, in order) and `n_emit` [B] of them. A chain's
  accepted nodes already sit in order after the root, so it only advances the length. (Moving an
  autoregressive round's one row onto itself made XLA copy every layer's cache twice.)"""
  return cache.advance(n_emit) if chain else cache.commit(path, n_emit)


def _round(spec: _Spec, params, dparams, drafter, eos_ids, s: DecodeState,
           head_kernel: jax.Array | None = None) -> DecodeState:
  """draft -> verify [pending | tree] in one target call -> accept -> commit -> update."""
  tree, s, accept_key = _draft_phase(spec, dparams, drafter, s)
  return _constrain(spec, _verify_phase(spec, params, dparams, drafter, eos_ids, tree, s,
                                        accept_key, head_kernel=head_kernel))


def _generate_program(spec: _Spec, params, drafter, prompts, prompt_lens, live, eos_ids, rng,
                      sampling, max_new, cache) -> DecodeState:
  def rounds(dparams, state: DecodeState) -> DecodeState:
    head = _head_kernel(spec, params)  # once, before the loop
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: _round(spec, params, dparams, drafter, eos_ids, s, head), state)
  return _prefill(spec, params, drafter, prompts, prompt_lens, live, eos_ids, rng, sampling,
                  max_new, cache, decode=rounds)


_COMPILED: dict[tuple, jax.stages.Compiled] = {}


def release_compiled() -> None:
  """Drops every compiled program (`generate`'s and jax's caches). A long job that compiles
  hundreds of programs (a test session, `experiments.reproduce all`) releases them between its
  parts: each executable holds mapped code sections, and a process runs out of mappings (LLVM's
  "Unable to allocate section memory") long before it runs out of memory."""
  _COMPILED.clear()
  jax.clear_caches()


# The cache's position in _generate_program's arguments: the program takes it over (donates it).
_CACHE_ARG = 10


def _mesh_context(mesh):
  """Traces under `jax.set_mesh(mesh)` so mesh-aware code (the Pallas attention's shard_map)
  sees the mesh; a no-op on one device."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _arg_shardings(args) -> tuple:
  return jax.tree.map(lambda a: a.sharding, args)


def _compiled(spec: _Spec, *args) -> tuple[jax.stages.Compiled, float]:
  """AOT-compiles once per (spec, drafter structure, shapes); returns it and the compile time.

  On a mesh the program's in_shardings are its arguments' (placed by `_setup`) and its
  out_shardings the loop state's layout; the cache argument is donated either way."""
  leaves, treedef = jax.tree.flatten(args)
  key = (spec, treedef) + tuple((a.shape, a.dtype) for a in leaves)
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  if spec.mesh is None:
    fn = jax.jit(_generate_program, static_argnums=0, donate_argnums=_CACHE_ARG)
  else:
    fn = jax.jit(_generate_program, static_argnums=0, donate_argnums=_CACHE_ARG,
                 in_shardings=_arg_shardings(args), out_shardings=_state_shardings(spec))
  with _mesh_context(spec.mesh):
    _COMPILED[key] = fn.lower(spec, *args).compile()
  return _COMPILED[key], time.perf_counter() - start


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


def _setup(target: Target, prompts, max_new_tokens: int, drafter, sampling: SamplingConfig,
           seed: int, eos_token_id, pad_to: int | None) -> tuple[_Spec, tuple, int]:
  """Validates the inputs and builds the static spec, the array arguments of a program (placed
  on the target's mesh when it has one) and the number of real rows (the rest are padding)."""
  cfg = target.config
  max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=1)
  seed = checks.integer("seed", seed)
  if not 0 <= seed < SEED_LIMIT:
    raise ValueError(f"seed must be an int in [0, 2**32), got {seed}")
  check_drafter(drafter, cfg)
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
  spec = _Spec(cfg, mesh=mesh, cache_len=cache_length(
      p, max_new_tokens, drafter.num_nodes, cfg.max_position_embeddings), copied_drafter=copied,
      head_copy=decoder.copies_head(cfg, target.platform, drafter.num_nodes + 1))
  n_real = len(ids)
  rows = ids + [ids[-1]] * (batch_rows(n_real, mesh) - n_real)  # pad rows: done
  prompt_arr = np.zeros((len(rows), p), np.int32)
  for i, row in enumerate(rows):
    prompt_arr[i, :len(row)] = row
  batch = (prompt_arr, np.asarray([len(r) for r in rows], np.int32),
           np.arange(len(rows)) < n_real)
  shared = (_eos_array(cfg, eos_token_id), jax.random.key(seed))
  knobs = (jax.tree.map(lambda x: np.asarray(x, np.float32), sampling),
           np.asarray(max_new_tokens, np.int32))
  if mesh is None:
    batch, shared = tuple(map(jnp.asarray, batch)), (jnp.asarray(shared[0]), shared[1])
    knobs = jax.tree.map(jnp.asarray, knobs)
  else:
    def _global(a: np.ndarray, where: jax.sharding.NamedSharding) -> jax.Array:
      # `a` (the same value on every process) laid out by `where`, each process placing only
      # its own devices' slices: unlike device_put, no cross-process check that the values
      # agree, and it works when the mesh spans other processes' devices.
      return jax.make_array_from_callback(a.shape, where, lambda index: a[index])

    drafter = sharding.place_drafter(drafter, target, mesh, copied=copied)
    batch = tuple(_global(a, sharding.batch_sharding(mesh)) for a in batch)
    eos, key = shared
    rep = sharding.replicated(mesh)
    # A key array is not a plain array that device_put can spread over other processes'
    # devices: its raw data is placed instead and wrapped again.
    key_data = _global(np.asarray(jax.random.key_data(key)), rep)
    shared = (_global(eos, rep), jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(key)))
    knobs = jax.tree.map(lambda a: _global(a, rep), knobs)
  args = (target.params, drafter, *batch, *shared, *knobs, _init_cache(spec, len(rows)))
  return spec, args, n_real


def _to_host(x: jax.Array) -> np.ndarray:
  """The whole of a (possibly multi-process) array as numpy, on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _check_finite(state: DecodeState) -> None:
  """The prefill's logits are checked in the program (one reduction): NaN weights would
  otherwise decode as token 0 without a word."""
  bad = np.flatnonzero(~_to_host(state.finite))
  if bad.size:
    raise ValueError(f"the target's logits are not finite (NaN/inf weights?) for prompt "
                     f"{int(bad[0])}")


def generate(target: Target, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             drafter: Drafter | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_token_id: int | Sequence[int] | None = None,
             pad_to: int | None = None, mesh=None) -> GenerateResult:
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
  Raises ValueError for a bad argument (before compiling), for a drafter built for another
  target, and after the run when the target's logits are not finite.
  """
  drafter = NoDrafter() if drafter is None else drafter
  if mesh is not None:
    target = target.on_mesh(mesh)
  spec, args, n_real = _setup(target, prompts, max_new_tokens, drafter,
                              SamplingConfig(temperature, top_k, top_p), seed, eos_token_id,
                              pad_to)
  program, compile_seconds = _compiled(spec, *args)
  eos = _to_host(args[5])
  start = time.perf_counter()
  state = jax.block_until_ready(program(*args))
  wall = time.perf_counter() - start
  _check_finite(state)
  tokens = _collect(state, eos, max_new_tokens)[:n_real]
  calls = _to_host(state.calls)[:n_real]
  n_new = sum(len(t) for t in tokens)
  rounds = int(_to_host(state.rounds))
  stats = Stats(
      tokens_per_second=n_new / wall if wall > 0 else float("inf"),
      tau=float(np.mean([metrics.tau(len(t), c) for t, c in zip(tokens, calls)])),
      target_calls=rounds + 1,
      drafter_calls=rounds if drafter.num_nodes else 0,
      new_tokens=n_new,
      accepted_by_depth=tuple(int(x) for x in _to_host(state.accepted_hist)),
      wall_seconds=wall,
      compile_seconds=compile_seconds,
      compiled=compile_seconds > 0,
      row_calls=tuple(int(c) for c in calls),
      rounds_by_size=_rounds_by_size(drafter, state),
  )
  text = [target.decode(t) for t in tokens] if target.tokenizer is not None else None
  return GenerateResult(tokens, stats, text, state.drafter_state)


def profile_phases(target: Target, prompts, *, drafter: Drafter | None = None,
                   max_new_tokens: int = 64, repeats: int = 20, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, pad_to: int | None = None,
                   trials: int = 5) -> dict[str, float]:
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
  see that (`specjax.benchmark` marks such cells). The ideal speedup of a method is
  tau * t_AR_step / (t_draft + t_verify); a run gets close to it when its prefill and its
  per-call costs are small beside its rounds.
  """
  trials = checks.integer("trials", trials, lo=1)
  repeats = checks.integer("repeats", repeats, lo=1)
  # One round at least: a budget of one token is the prefill alone.
  max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, lo=2)
  spec, args = _profiler_setup(target, prompts, drafter, max_new_tokens,
                               SamplingConfig(temperature, top_k, top_p), pad_to)
  with _mesh_context(spec.mesh):
    return _profile(spec, args, repeats, trials)


def _profiler_setup(target: Target, prompts, drafter: Drafter | None, max_new_tokens: int,
                    sampling: SamplingConfig, pad_to: int | None) -> tuple[_Spec, tuple]:
  """The spec and arguments of the profiler's programs (seed 0, no EOS; None: no drafter)."""
  drafter = NoDrafter() if drafter is None else drafter
  spec, args, _ = _setup(target, prompts, max_new_tokens, drafter, sampling, 0, [], pad_to)
  return spec, args


def _budget_runs(spec: _Spec, args: tuple
                 ) -> tuple[Callable[[KVCache, bool], DecodeState], DecodeState]:
  """`run(cache, prefill_only)` runs `generate`'s compiled program on `args` into `cache`
  (taking it over, as `generate` does): with `args`' budget, or with a budget of one token,
  after which it stops, its prefill done. Also returns the prefill's state on `args`' own cache,
  ready to decode: `args`' budget back and its rows live again (the profiler's prompts stop at
  no EOS, so only batch padding is done)."""
  program, _ = _compiled(spec, *args)
  *head, max_new, cache = args
  budgets = {False: max_new, True: jnp.ones_like(max_new)}

  def run(cache: KVCache, prefill_only: bool) -> DecodeState:
    return program(*head, budgets[prefill_only], cache)

  live = args[4]
  return run, run(cache, True).replace(done=~live, max_new=max_new)


# The profiler's verify loop, jitted once at module level (the spec is static; the loop count is
# traced), so profiling the same method, shapes and sampling mode again reuses it.
@functools.partial(jax.jit, static_argnums=0)
def _verify_loop_program(spec: _Spec, params, drafter, eos_ids, state: DecodeState, n_verify,
                         size) -> DecodeState:
  """From a prefilled `state`: one draft, then `n_verify` verify phases of that draft, each at
  the drafter's verify size of index `size` (traced: one program for all of them)."""
  dparams, head = _drafter_params(spec, params), _head_kernel(spec, params)
  tree, state, key = _draft_phase(spec, dparams, drafter, state)
  return jax.lax.fori_loop(
      0, n_verify, lambda i, s: _verify_phase(spec, params, dparams, drafter, eos_ids, tree, s,
                                              key, size, head), state)


def _rounds(spec: _Spec, params, drafter, eos_ids, state: DecodeState, n_round) -> DecodeState:
  """From a prefilled `state`: `n_round` whole rounds (draft, then verify) in a fori loop."""
  dparams, head = _drafter_params(spec, params), _head_kernel(spec, params)
  return jax.lax.fori_loop(
      0, n_round, lambda i, s: _round(spec, params, dparams, drafter, eos_ids, s, head), state)


def round_loop(target: Target, prompts, *, drafter: Drafter | None = None,
               max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, pad_to: int | None = None):
  """Whole rounds of `generate`'s loop from a prefilled state, for tools that look inside them
  (e.g. `specjax.profiling.kernel_times`): returns `(run, hlo)`, where `run(n)` runs n whole
  rounds (draft, then verify) in a loop of their own and waits for them, and `hlo` is the
  compiled program's optimized HLO text (whose instruction names are the kernels a profiler
  sees)."""
  spec, args = _profiler_setup(target, prompts, drafter, max_new_tokens,
                               SamplingConfig(temperature, top_k, top_p), pad_to)
  params, drafter, eos = args[0], args[1], args[5]
  with _mesh_context(spec.mesh):
    _, state = _budget_runs(spec, args)
    # The op metadata (named scopes) is the point here, and the compilation caches key
    # programs without it: a program could come back from memory or disk as compiled from an
    # older version of the code, with that version's metadata. A function of its own (traced
    # and lowered afresh) with the metadata in the persistent cache's key cannot.
    def profiled_loops(*args):
      return _rounds(spec, *args)

    lowered = jax.jit(profiled_loops).lower(params, drafter, eos, state, 0)
    key_option = "jax_compilation_cache_include_metadata_in_key"
    before = getattr(jax.config, key_option)
    jax.config.update(key_option, True)
    try:
      compiled = lowered.compile()
    finally:
      jax.config.update(key_option, before)

  def run(n: int) -> DecodeState:
    with _mesh_context(spec.mesh):
      return jax.block_until_ready(compiled(params, drafter, eos, state, n))

  return run, compiled.as_text()


def _profile(spec: _Spec, args: tuple, repeats: int, trials: int) -> dict[str, float]:
  params, drafter, eos = args[0], args[1], args[5]
  run, state = _budget_runs(spec, args)
  batch = args[2].shape[0]  # the prompts' rows
  n = 2 * repeats

  def call(prefill_only: bool) -> tuple[float, DecodeState]:
    cache = jax.block_until_ready(_init_cache(spec, batch))  # fresh: donated
    start = time.perf_counter()
    out = jax.block_until_ready(run(cache, prefill_only))
    return time.perf_counter() - start, out

  def verify(k: int, size: int = 0) -> DecodeState:
    return jax.block_until_ready(_verify_loop_program(spec, params, drafter, eos, state, k,
                                                      np.int32(size)))

  # The first `trials` calls of each warm up (on a mesh the first few run up to 2x slower); then
  # every timing of a trial runs beside the others, so a drift in the machine's speed hits them
  # alike (t_draft is a difference of two of them).
  for _ in range(trials):
    call(True)
    _, out = call(False)
  # A drafter with several verify sizes: each size the run used is timed, and the verify phase
  # is their mean weighted by the run's rounds at each.
  rounds, by_size = int(_to_host(out.rounds)), _to_host(out.size_hist)
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
  prefill = np.asarray(times["prefill"])
  t_round, round_trials = timing.per_unit(times["full"], prefill, rounds)

  def spread(per_trial: np.ndarray) -> float:
    return float(per_trial.max() - per_trial.min())

  if drafter.num_nodes:
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


def _rounds_by_size(drafter: Drafter, state: DecodeState) -> dict[int, int]:
  """{n: rounds verified at n nodes} for a drafter with more than one verify size, else {}."""
  sizes = verify_sizes_of(drafter)
  if len(sizes) == 1:
    return {}
  return {n: int(k) for n, k in zip(sizes, _to_host(state.size_hist))}


def _collect(state: DecodeState, eos_ids: np.ndarray, max_new_tokens: int) -> list[list[int]]:
  history, hist_len = _to_host(state.history), _to_host(state.hist_len)
  rows = []
  for row, start, end in zip(history, _to_host(state.prompt_len), hist_len):
    row = row[start:min(end, start + max_new_tokens)].tolist()
    for i, t in enumerate(row):
      if t in eos_ids:
        row = row[:i + 1]
        break
    rows.append(row)
  return rows
