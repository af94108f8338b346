"""The jitted program of `generate`: the prompt pass, then a `lax.while_loop` of rounds.

Read top to bottom: `generate_program` runs `prompt_phase` (the prompts' forward pass and each
row's first token), then `start` (the loop's state and the drafter's `init`) and `decode` (the
loop), in which each round (`run_round`) drafts a tree (`draft_phase`), verifies
`[pending | tree]` in one target call (`verify_phase`), accepts, commits the accepted path to the
cache and updates the drafter.

Conventions (the field's):
  * the cache holds every emitted token except the last one, `pending`, whose KV is written by
    the next round: a round feeds `[pending | draft tree]`, so autoregressive decoding is the round
    with an empty tree;
  * a round emits the accepted draft tokens plus one bonus token sampled from the target;
  * `calls` counts target forward passes (prefill included), so AR has tau = 1.0 exactly.

Everything a round reads but never changes (params, drafter, EOS ids, the LM head it verifies
with) travels in one `Loop`; what it changes is the `DecodeState`. The host side (`generate`,
input validation, compile cache) is `specjax.decoding`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax import sharding, trees, verify
from specjax.drafters.base import (
    DraftContext,
    Drafter,
    Prefill,
    RoundResult,
    TargetView,
    verify_sizes_of,
)
from specjax.models import decoder
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingConfig, row_keys, sample

# The prefill runs in chunks of this many prompt positions, as many as the longest prompt needs: a
# prompt padded to its bucket (or to a whole benchmark set's) costs its own length rounded up to a
# chunk, not the bucket. Buckets from 64 on are multiples of it; a shorter or odd `pad_to` is one
# chunk.
PREFILL_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Spec:
  """The static part of a compiled program (its cache key, with the arguments' shapes)."""

  config: ModelConfig  # the sampling mode is in the sampling argument's tree structure
  cache_len: int  # S: slots of the KV cache and of the token history
  mesh: jax.sharding.Mesh | None = None
  # The drafter is copied whole onto every device (`sharding.replicates_drafter`) and reads a
  # whole copy of the target's embedding table.
  copied_drafter: bool = False
  # The target's forwards read the LM head from a copy laid out [E, V] (`decoder.copies_head`).
  head_copy: bool = False
  rule: verify.Rule = verify.RECURSIVE  # how each round's tree is accepted


@struct.dataclass
class ProgramArgs:
  """The program's array arguments besides the cache (which it takes over: donated)."""

  params: Any  # the target's
  drafter: Drafter
  prompts: jax.Array  # int32[B, P]  right-padded
  prompt_lens: jax.Array  # int32[B]
  live: jax.Array  # bool[B]  False: a padding row, which starts done
  eos_ids: jax.Array  # int32[n]  ids that stop a row ([-1]: none)
  rng: jax.Array  # a key
  sampling: SamplingConfig  # temperature and top-p traced, the mode static
  max_new: jax.Array  # int32[]  max_new_tokens (the cache holds its bucket)


@struct.dataclass
class DecodeState:
  """Everything the loop carries; a rejected draft is just a length that did not advance."""

  cache: KVCache
  history: jax.Array  # int32[B, S]  prompt then emitted tokens; the last one is `pending`
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


@struct.dataclass
class Loop:
  """What every round reads and none changes, made once before the loop of rounds."""

  spec: Spec = struct.field(pytree_node=False)
  params: Any  # the target's
  dparams: Any  # the target's params as the drafter reads them (`drafter_params`)
  drafter: Drafter
  eos_ids: jax.Array  # int32[n]
  head: jax.Array | None  # the LM head verifications use (`head_kernel`; None: the model's own)

  @classmethod
  def of(cls, spec: Spec, args: ProgramArgs) -> Loop:
    return cls(spec, args.params, drafter_params(spec, args.params), args.drafter, args.eos_ids,
               head_kernel(spec, args.params))

  def view(self, sampling: SamplingConfig) -> TargetView:
    return TargetView(self.spec.config, sampling, self.dparams)


@struct.dataclass
class Prompted:
  """The prompt pass's results, from which the loop's state starts."""

  last: jax.Array  # [B, V]  the logits at each row's last prompt token
  hidden: jax.Array | None  # [H, B, P, E]  the drafter's hidden states of the prompt, or None
  cache: KVCache  # the prompts' K/V at slots [0, P), its length left at 0
  first: jax.Array  # int32[B]  each row's first new token
  done: jax.Array  # bool[B]
  finite: jax.Array  # bool[B]
  rng: jax.Array  # the key the rounds draw from


# ------------------------------------------------------------------------------------------------
# Layout and the values made once per program


def cache_layout(cfg: ModelConfig, mesh) -> KVCache:
  kv = (jax.sharding.NamedSharding(mesh, sharding.cache_spec(cfg, mesh)),) * cfg.num_layers
  return KVCache(k=kv, v=kv, length=sharding.batch_sharding(mesh))


def state_shardings(spec: Spec) -> DecodeState:
  """The loop state's layout: rows over data, counters replicated; the drafter's state and the
  sampling values are left to the partitioner (None), which propagates them from the arrays they
  are computed from."""
  rows, rep = sharding.batch_sharding(spec.mesh), sharding.replicated(spec.mesh)
  return DecodeState(cache=cache_layout(spec.config, spec.mesh), history=rows, hist_len=rows,
                     prompt_len=rows, done=rows, calls=rows, rounds=rep, accepted_hist=rep,
                     size_hist=rep, rng=rep, drafter_state=None, finite=rows, sampling=None,
                     max_new=rep)


def constrain(spec: Spec, state: DecodeState) -> DecodeState:
  """Pins the loop carry to `state_shardings` (the drafter state and sampling values excepted)
  on a mesh."""
  if spec.mesh is None:
    return state
  fixed = state.replace(drafter_state=None, sampling=None)
  fixed = jax.lax.with_sharding_constraint(fixed, state_shardings(spec))
  return fixed.replace(drafter_state=state.drafter_state, sampling=state.sampling)


def head_kernel(spec: Spec, params) -> jax.Array | None:
  """The LM head weight a program's verifications use (`decoder.head_kernel`, None for the
  model's own). The prompt pass keeps the model's own (its logits are one row per chunk)."""
  return decoder.head_kernel(spec.config, params) if spec.head_copy else None


def drafter_params(spec: Spec, params):
  """The target params a drafter reads: beside a copied drafter, with a whole copy of the
  embedding table on every device (`sharding.with_whole_embedding`)."""
  return sharding.with_whole_embedding(params) if spec.copied_drafter else params


def _is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == eos_ids, axis=-1)


# ------------------------------------------------------------------------------------------------
# The program


def generate_program(spec: Spec, args: ProgramArgs, cache: KVCache) -> DecodeState:
  """`generate`'s whole run: the prompt pass, then the loop of rounds until every row is done.

  On a mesh, every loop or branch of the program that communicates is ordered by data against
  every other collective in it: XLA's CPU runtime runs independent operations at the same time,
  and two devices that enter two collectives in opposite orders wait for each other forever
  (`specjax.lab.hlo.races` finds such pairs; the tests check every method's program). So
  everything after the prompt loop runs in one branch taken on the first tokens the loop gives:
  the whole embedding table a copied drafter reads (gathered there), the history, the drafter's
  `init` and the rounds, with what XLA hoists out of their loop."""
  prompted = prompt_phase(spec, args, cache)

  def stop() -> DecodeState:
    return start(Loop.of(spec, args), args, prompted)

  def run() -> DecodeState:
    loop = Loop.of(spec, args)
    return decode(loop, start(loop, args, prompted))

  return jax.lax.cond(jnp.all(prompted.done), stop, run)


def prefill(spec: Spec, args: ProgramArgs, cache: KVCache) -> DecodeState:
  """The state the loop of rounds starts from (what tests decode from by hand)."""
  return start(Loop.of(spec, args), args, prompt_phase(spec, args, cache))


def decode(loop: Loop, state: DecodeState) -> DecodeState:
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), functools.partial(run_round, loop), state)


def prompt_phase(spec: Spec, args: ProgramArgs, cache: KVCache) -> Prompted:
  """The prompts' forward pass and each row's first token; rows with `live` False (batch
  padding), whose first token is EOS, or whose logits are not finite start done."""
  b = args.prompts.shape[0]
  last, hidden, cache = prompt_pass(spec.config, args.params, args.prompts, args.prompt_lens,
                                    cache, args.drafter.hidden_layers)
  rng, key, _ = jax.random.split(args.rng, 3)
  first = jax.vmap(lambda k, x: sample(k, x, args.sampling))(row_keys(key, b), last)
  # A row whose logits are not finite stops at once (`generate` raises for it).
  finite = jnp.all(jnp.isfinite(last), axis=-1) | ~args.live
  done = _is_eos(first, args.eos_ids) | (args.max_new <= 1) | ~args.live | ~finite
  return Prompted(last, hidden, cache, first, done, finite, rng)


def start(loop: Loop, args: ProgramArgs, p: Prompted) -> DecodeState:
  """The loop's first state: the history (prompt and first token), the cache holding the
  prompts, and the drafter's `init` on the prefill."""
  spec, drafter = loop.spec, loop.drafter
  b, plen = args.prompts.shape
  history = jnp.zeros((b, spec.cache_len), jnp.int32).at[:, :plen].set(args.prompts)
  history = history.at[jnp.arange(b), args.prompt_lens].set(p.first)
  prefilled = p.cache.advance(args.prompt_lens)
  drafter_state = drafter.init(loop.view(args.sampling), Prefill(
      args.prompts, history, args.prompt_lens + 1, p.last, p.hidden, prefilled))
  return constrain(spec, DecodeState(
      cache=prefilled, history=history, hist_len=args.prompt_lens + 1,
      prompt_len=args.prompt_lens, done=p.done, calls=jnp.ones((b,), jnp.int32),
      rounds=jnp.zeros((), jnp.int32),
      accepted_hist=jnp.zeros((drafter.num_nodes + 1,), jnp.int32),
      size_hist=jnp.zeros((len(verify_sizes_of(drafter)),), jnp.int32), rng=p.rng,
      drafter_state=drafter_state, finite=p.finite, sampling=args.sampling,
      max_new=args.max_new))


def prefill_chunks(prompt_len: int, padded_len: int) -> int:
  """How many forward passes the prefill of a prompt of `prompt_len` tokens padded to
  `padded_len` runs (`prompt_pass`; a batch runs as many as its longest prompt needs)."""
  c = PREFILL_CHUNK
  return -(-prompt_len // c) if padded_len > c and padded_len % c == 0 else 1


@jax.named_scope("prefill")
def prompt_pass(cfg: ModelConfig, params, prompts, prompt_lens, cache: KVCache,
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

  def chunk_pass(begin, cache):
    pos = begin + jnp.arange(c, dtype=jnp.int32)
    new_mask = causal[None] & (pos[None, None, :] < prompt_lens[:, None, None])
    at = jnp.clip(prompt_lens - 1 - begin, 0, c - 1)[:, None]  # its logits' row (`chunk`)
    tokens = jax.lax.dynamic_slice_in_dim(prompts, begin, c, axis=1)
    return decoder.forward(cfg, params, tokens, jnp.broadcast_to(pos, (b, c)), new_mask,
                           cache.replace(length=jnp.full((b,), begin, jnp.int32)),
                           hidden_layers=hidden_layers, logits_index=at)

  def chunk(i, carry):
    last, hidden, cache = carry
    begin = i * c
    out = chunk_pass(begin, cache)
    offset = prompt_lens - 1 - begin  # each row's last prompt token, if in this chunk
    last = jnp.where(((offset >= 0) & (offset < c))[:, None], out.logits[:, 0], last)
    if hidden is not None:
      hidden = jax.lax.dynamic_update_slice_in_dim(hidden, out.hidden, begin, axis=2)
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


# ------------------------------------------------------------------------------------------------
# One round


def run_round(loop: Loop, s: DecodeState) -> DecodeState:
  """draft -> verify [pending | tree] in one target call -> accept -> commit -> update."""
  tree, s, accept_key = draft_phase(loop, s)
  return constrain(loop.spec, verify_phase(loop, tree, s, accept_key))


@jax.named_scope("draft")
def draft_phase(loop: Loop, s: DecodeState) -> tuple[trees.Tree, DecodeState, jax.Array]:
  """The drafter's tree for this round, the state with its new drafter state and target cache,
  and the key acceptance draws from."""
  rng, draft_key, accept_key = jax.random.split(s.rng, 3)
  tree, drafter_state, cache = loop.drafter.draft(
      loop.view(s.sampling), s.drafter_state,
      DraftContext(s.history, s.hist_len, s.pending, s.cache, draft_key))
  return tree, s.replace(cache=cache, drafter_state=drafter_state, rng=rng), accept_key


def size_index(sizes: tuple[int, ...], tree: trees.Tree, live: jax.Array) -> jax.Array:
  """int32[]: the index of the smallest of `sizes` that holds every live row's last valid node
  (the last size, N, holds them all)."""
  if len(sizes) == 1:
    return jnp.zeros((), jnp.int32)
  node = jnp.arange(1, tree.num_nodes + 1, dtype=jnp.int32)
  need = jnp.max(jnp.where(tree.valid & live[:, None], node, 0))
  return jnp.sum(need > jnp.asarray(sizes[:-1], jnp.int32)).astype(jnp.int32)


@jax.named_scope("verify")
def verify_phase(loop: Loop, tree: trees.Tree, s: DecodeState, accept_key: jax.Array,
                 size: jax.Array | None = None) -> DecodeState:
  """Verify the tree in one target call, at the smallest of the drafter's verify sizes that
  holds its valid nodes (`size`: an index into those sizes instead, the profiler's choice).

  More than one size: one `lax.cond` per size, in a row, whose other branch passes the state
  through; a round runs one verification. (A `lax.switch` over the sizes, or any conditional
  with more than one branch writing the cache, makes XLA copy the whole cache in every round.)
  """
  sizes = verify_sizes_of(loop.drafter)
  if size is None:
    size = size_index(sizes, tree, ~s.done)
  s = s.replace(size_hist=s.size_hist.at[size].add(1))
  if len(sizes) == 1:
    return verify_nodes(loop, tree, s, accept_key)
  for i, n in enumerate(sizes):
    s = jax.lax.cond(size == i, functools.partial(verify_nodes, loop, tree.head(n),
                                                  accept_key=accept_key), lambda state: state, s)
  return s


def verify_nodes(loop: Loop, tree: trees.Tree, s: DecodeState, accept_key: jax.Array
                 ) -> DecodeState:
  """Verify [pending | tree] in one target call, accept, commit, append, update the drafter."""
  drafter = loop.drafter
  b = s.hist_len.shape[0]
  block = jnp.concatenate([s.pending[:, None], tree.tokens], axis=1)  # [B, N+1]
  positions = s.cache.length[:, None] + trees.positions_offsets(tree)
  out = decoder.forward(loop.spec.config, loop.params, block, positions, trees.verify_mask(tree),
                        s.cache, hidden_layers=drafter.hidden_layers, head_kernel=loop.head)
  with jax.named_scope("accept"):
    acc = verify.accept(tree, out.logits, s.sampling, accept_key, rule=loop.spec.rule)

  live = ~s.done
  n_emit = jnp.where(live, acc.n_accepted + 1, 0)  # accepted nodes + the bonus token
  idx = jnp.arange(block.shape[1])[None, :]
  # Emitted tokens go after the history; a finished row writes out of bounds (dropped).
  cols = jnp.where(idx < n_emit[:, None], s.hist_len[:, None] + idx, s.history.shape[1])
  history = s.history.at[jnp.arange(b)[:, None], cols].set(acc.tokens, mode="drop")
  hist_len = s.hist_len + n_emit
  emitted_eos = jnp.any(_is_eos(acc.tokens, loop.eos_ids) & (idx < n_emit[:, None]), axis=1)
  with jax.named_scope("drafter_update"):
    drafter_state = drafter.update(loop.view(s.sampling), s.drafter_state, RoundResult(
        tree, acc, block, out.logits, out.hidden, live, history, hist_len))
  depth_bin = jnp.where(live, acc.n_accepted, drafter.num_nodes + 1)  # dead rows: dropped
  return s.replace(
      cache=commit_round(out.cache, acc.path, n_emit, chain=tree.chain),
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
