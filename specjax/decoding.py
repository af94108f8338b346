"""`generate`: prefill plus one `lax.while_loop` of rounds, all inside a single jit call.

Conventions (the field's, see DESIGN.md):
  * the cache holds every emitted token except the last one, `pending`, whose KV is written by
    the next round: a round feeds `[pending | draft tree]`, so autoregressive decoding is the round
    with an empty tree;
  * a round emits the accepted draft tokens plus one bonus token sampled from the target;
  * `target_calls` counts target forward passes (prefill included), so AR has tau = 1.0 exactly.

Shapes are static per (batch, prompt bucket, max_new_tokens); prompt lengths are padded up to a
power-of-two bucket so a new prompt length inside a bucket reuses the compiled program.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models import decoder
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingConfig, row_keys, sample
from specjax.target import Target

MIN_BUCKET = 16


@struct.dataclass
class DecodeState:
  """Everything the loop carries; a rejected draft is just a length that did not advance."""

  cache: KVCache
  pending: jax.Array  # int32[B]   last emitted token (its KV is not in the cache yet)
  out: jax.Array  # int32[B, W]    emitted tokens; W = max_new_tokens + slack
  n_out: jax.Array  # int32[B]     tokens emitted so far per row
  done: jax.Array  # bool[B]       row hit EOS or max_new_tokens
  calls: jax.Array  # int32[B]     target forward passes that served this row
  rounds: jax.Array  # int32[]     loop iterations (target forward passes after prefill)
  rng: jax.Array


@dataclasses.dataclass(frozen=True)
class Stats:
  tokens_per_second: float  # emitted tokens / wall time of the compiled call (compile excluded)
  tau: float  # emitted tokens / target forward passes, averaged over rows
  target_calls: int  # target forward passes executed (prefill + rounds)
  new_tokens: int  # emitted tokens summed over rows (after EOS / max_new_tokens truncation)
  wall_seconds: float
  compile_seconds: float  # 0.0 when the program came from the cache
  compiled: bool  # True when this call had to compile


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  tokens: list[list[int]]  # new tokens per row, prompt excluded, EOS included when hit
  stats: Stats
  text: list[str] | None = None  # decoded tokens when the target has a tokenizer


@dataclasses.dataclass(frozen=True)
class _Spec:
  """The static part of a compiled generate program (its cache key with the array shapes)."""

  config: ModelConfig
  sampling: SamplingConfig
  max_new_tokens: int
  cache_len: int


def bucket_length(n: int, limit: int) -> int:
  """Smallest power of two >= n (at least MIN_BUCKET), capped at `limit`."""
  b = MIN_BUCKET
  while b < n:
    b *= 2
  return max(min(b, limit), n)


def _is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def _prefill(spec: _Spec, params, prompts, prompt_lens, eos_ids, rng) -> DecodeState:
  cfg = spec.config
  b, p = prompts.shape
  cache = decoder.init_cache(cfg, b, spec.cache_len)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  out = decoder.forward(cfg, params, prompts, positions, decoder.causal_mask(prompt_lens, p), cache,
                        logits_index=(prompt_lens - 1)[:, None])
  rng, key = jax.random.split(rng)
  first = jax.vmap(lambda k, x: sample(k, x, spec.sampling))(row_keys(key, b), out.logits[:, 0])
  width = spec.max_new_tokens + 1
  return DecodeState(
      cache=out.cache.advance(prompt_lens),
      pending=first,
      out=jnp.zeros((b, width), jnp.int32).at[:, 0].set(first),
      n_out=jnp.ones((b,), jnp.int32),
      done=_is_eos(first, eos_ids) | (spec.max_new_tokens <= 1),
      calls=jnp.ones((b,), jnp.int32),
      rounds=jnp.zeros((), jnp.int32),
      rng=rng,
  )


def _round(spec: _Spec, params, eos_ids, s: DecodeState) -> DecodeState:
  """One target call on `[pending]` (the empty draft tree); emits the bonus token."""
  cfg = spec.config
  b = s.pending.shape[0]
  out = decoder.forward(cfg, params, s.pending[:, None], s.cache.length[:, None],
                        jnp.ones((b, 1, 1), bool), s.cache)
  rng, key = jax.random.split(s.rng)
  nxt = jax.vmap(lambda k, x: sample(k, x, spec.sampling))(row_keys(key, b), out.logits[:, 0])
  live = ~s.done
  rows = jnp.arange(b)
  # A finished row writes out of bounds (dropped) and does not advance its cache.
  slot = jnp.where(live, s.n_out, s.out.shape[1])
  n_out = s.n_out + live
  return DecodeState(
      cache=out.cache.advance(live.astype(jnp.int32)),
      pending=jnp.where(live, nxt, s.pending),
      out=s.out.at[rows, slot].set(nxt, mode="drop"),
      n_out=n_out,
      done=s.done | (live & (_is_eos(nxt, eos_ids) | (n_out >= spec.max_new_tokens))),
      calls=s.calls + live,
      rounds=s.rounds + 1,
      rng=rng,
  )


def _generate_program(spec: _Spec, params, prompts, prompt_lens, eos_ids, rng) -> DecodeState:
  state = _prefill(spec, params, prompts, prompt_lens, eos_ids, rng)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                            lambda s: _round(spec, params, eos_ids, s), state)


_COMPILED: dict[tuple, jax.stages.Compiled] = {}


def _compiled(spec: _Spec, *args) -> tuple[jax.stages.Compiled, float]:
  """AOT-compiles once per (spec, shapes); returns the executable and the compile time spent."""
  key = (spec,) + tuple((a.shape, a.dtype) for a in jax.tree.leaves(args))
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  fn = jax.jit(_generate_program, static_argnums=0)
  _COMPILED[key] = fn.lower(spec, *args).compile()
  return _COMPILED[key], time.perf_counter() - start


def _prepare_prompts(target: Target, prompts) -> list[list[int]]:
  if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
    raise ValueError("prompts must be a list of prompts (strings or token-id lists), "
                     "not a single prompt")
  ids = [target.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
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
  if eos_token_id is None:
    eos = list(cfg.eos_token_id)
  elif isinstance(eos_token_id, int):
    eos = [eos_token_id]
  else:
    eos = list(eos_token_id)
  for e in eos:
    if not 0 <= e < cfg.vocab_size:
      raise ValueError(f"eos_token_id {e} outside the vocabulary [0, {cfg.vocab_size})")
  return np.asarray(eos or [-1], np.int32)  # -1 never matches a token: no EOS stop


def generate(target: Target, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_token_id: int | Sequence[int] | None = None) -> GenerateResult:
  """Generates up to `max_new_tokens` per prompt in one jit call.

  prompts: strings (encoded with the target's tokenizer) or lists of token ids; rows may differ
  in length. eos_token_id: ids that stop a row (default: the config's; [] disables). A row stops
  at its first EOS (kept in the output) or after exactly `max_new_tokens` tokens.
  """
  cfg = target.config
  sampling = SamplingConfig(temperature, top_k, top_p)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  ids = _prepare_prompts(target, prompts)
  longest = max(len(r) for r in ids)
  if longest + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the "
                     f"model's context of {cfg.max_position_embeddings} tokens")
  p = bucket_length(longest, cfg.max_position_embeddings)
  spec = _Spec(cfg, sampling, max_new_tokens, cache_len=p + max_new_tokens + 1)
  prompt_arr = np.zeros((len(ids), p), np.int32)
  for i, row in enumerate(ids):
    prompt_arr[i, :len(row)] = row
  args = (target.params, jnp.asarray(prompt_arr),
          jnp.asarray([len(r) for r in ids], jnp.int32),
          jnp.asarray(_eos_array(cfg, eos_token_id)), jax.random.key(seed))
  program, compile_seconds = _compiled(spec, *args)
  start = time.perf_counter()
  state = jax.block_until_ready(program(*args))
  wall = time.perf_counter() - start
  tokens = _collect(state, np.asarray(args[3]), max_new_tokens)
  calls = np.asarray(state.calls)
  n_new = sum(len(t) for t in tokens)
  stats = Stats(
      tokens_per_second=n_new / wall if wall > 0 else float("inf"),
      tau=float(np.mean([len(t) / c for t, c in zip(tokens, calls)])),
      target_calls=int(state.rounds) + 1,
      new_tokens=n_new,
      wall_seconds=wall,
      compile_seconds=compile_seconds,
      compiled=compile_seconds > 0,
  )
  text = [target.decode(t) for t in tokens] if target.tokenizer is not None else None
  return GenerateResult(tokens, stats, text)


def _collect(state: DecodeState, eos_ids: np.ndarray, max_new_tokens: int) -> list[list[int]]:
  out, n_out = np.asarray(state.out), np.asarray(state.n_out)
  rows = []
  for row, n in zip(out, n_out):
    row = row[:min(n, max_new_tokens)].tolist()
    for i, t in enumerate(row):
      if t in eos_ids:
        row = row[:i + 1]
        break
    rows.append(row)
  return rows
