"""Sampling configuration and the logits processing shared by AR decoding and verification.

Temperature, top-k and top-p are applied to the *target* logits in exactly the order and with the
tie rules of transformers' `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, so
that "the target's distribution" means the same thing here as in the reference implementation.
Speculative acceptance rules (specjax.verify) consume `target_probs`, never raw logits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checks, sharding

# Below this, logits / temperature overflows float32 (every finite logit becomes +-inf and the
# softmax NaN): greedy (0) is the limit a smaller temperature would approach anyway.
MIN_TEMPERATURE = 1e-4


class SamplingMode(NamedTuple):
  """The static part of a `SamplingConfig`: what a compiled program's structure depends on.
  Temperature and top-p are traced values inside it, so every temperature > 0 and every top-p
  < 1 share one program; top-k is static (`lax.top_k` needs a static k)."""

  greedy: bool
  top_k: int
  nucleus: bool  # top-p filtering is on (top_p < 1)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature == 0 is greedy (argmax); top_k == 0 and top_p == 1.0 disable those filters.

  Values are checked and normalised (float, int, float) at construction. The config is a pytree
  whose leaves are the temperature (unless greedy) and top-p (when filtering) and whose static
  part is its `mode`: passed to a jitted function, a new temperature or top-p reuses the
  compiled program, while greedy decoding, top-k and turning top-p on or off select another.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    t = checks.real("temperature", self.temperature)
    if not t >= 0.0:  # also rejects NaN
      raise ValueError(f"temperature must be >= 0 (0: greedy), got {t}")
    if t == math.inf:
      raise ValueError(f"temperature must be finite, got {t}")
    if 0.0 < t < MIN_TEMPERATURE:
      raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller ones "
                       f"overflow the logits' division), got {t}")
    top_k = checks.integer("top_k", self.top_k, lo=0)
    top_p = checks.real("top_p", self.top_p)
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    object.__setattr__(self, "temperature", t)
    object.__setattr__(self, "top_k", top_k)
    object.__setattr__(self, "top_p", top_p)
    object.__setattr__(self, "_mode", SamplingMode(t == 0.0, top_k, top_p < 1.0))
    # Top-p drops the tokens whose cumulative probability is <= 1 - top_p. The difference is
    # taken here in double precision, as transformers takes it, and only then rounded to the
    # logits' float32: 1 - float32(top_p) would move the boundary.
    object.__setattr__(self, "_drop_mass", 1.0 - top_p)

  @property
  def mode(self) -> SamplingMode:
    return self._mode

  @property
  def greedy(self) -> bool:
    return self._mode.greedy

  @property
  def nucleus(self) -> bool:
    return self._mode.nucleus

  @property
  def drop_mass(self) -> Any:
    """1 - top_p: the cumulative probability at or below which top-p drops tokens."""
    return self._drop_mass

  @classmethod
  def from_mode(cls, mode: SamplingMode, temperature: Any = 0.0, drop_mass: Any = 0.0
                ) -> SamplingConfig:
    """A config of `mode` with the given (possibly traced) temperature and 1 - top_p; a greedy
    mode keeps temperature 0 and a mode without nucleus filtering top-p 1, whatever is passed.
    Values are not checked: they come from a config that was."""
    cfg = object.__new__(cls)
    drop_mass = drop_mass if mode.nucleus else 0.0
    object.__setattr__(cfg, "_mode", mode)
    object.__setattr__(cfg, "temperature", 0.0 if mode.greedy else temperature)
    object.__setattr__(cfg, "top_k", mode.top_k)
    # Lowering unflattens with non-numeric leaves (argument descriptions): top_p is derived
    # from numbers only and otherwise holds the leaf itself.
    numeric = isinstance(drop_mass, (float, int, np.ndarray, np.generic, jax.Array))
    object.__setattr__(cfg, "top_p", 1.0 - drop_mass if numeric else drop_mass)
    object.__setattr__(cfg, "_drop_mass", drop_mass)
    return cfg


def _flatten(cfg: SamplingConfig):
  mode = cfg.mode
  leaves = ([] if mode.greedy else [cfg.temperature]) + ([cfg.drop_mass] if mode.nucleus else [])
  return leaves, mode


def _unflatten(mode: SamplingMode, leaves) -> SamplingConfig:
  leaves = list(leaves)
  temperature = 0.0 if mode.greedy else leaves.pop(0)
  return SamplingConfig.from_mode(mode, temperature, leaves[0] if mode.nucleus else 0.0)


jax.tree_util.register_pytree_node(SamplingConfig, _flatten, _unflatten)

GREEDY = SamplingConfig()  # greedy decoding: the default of the tools that take a config


def argmax(x: jax.Array) -> jax.Array:
  """int32[...] index of the largest entry of `[..., V]`: `jnp.argmax`'s result (first index of
  the maximum, of the first NaN if any), computed as a max, a compare and a min.

  XLA's CPU backend lowers `jnp.argmax` to a (value, index) variadic reduce that does not
  vectorise: over an 8192-token vocabulary it costs several times the three plain reductions,
  which matters on the decode path (one argmax per verified row per round).

  Traced under a mesh that splits the vocabulary (logits from a vocab-split LM head), each
  shard first reduces its own slice, and the shards' (max, index) pairs meet in one all-gather:
  the two all-reduces of the plain max and min (one for each) would cost a collective more on
  every decode step.
  """
  mesh = sharding.tracing_mesh()
  parts = 1 if mesh is None else mesh.shape[sharding.MODEL]
  if parts == 1 or x.ndim < 2 or x.shape[-1] % parts:
    return _max_and_argmax(x)[1]
  lead = ("batch",) + (None,) * (x.ndim - 2)
  width = x.shape[-1] // parts
  chunks = sharding.constrain(x.reshape(x.shape[:-1] + (parts, width)), lead + ("vocab", None))
  m, i = _max_and_argmax(chunks)  # [..., P]: each shard's slice, reduced where it lies
  m = m.astype(jnp.float32)  # exact for every float dtype, and an int32's width
  pairs = jnp.stack([m, jax.lax.bitcast_convert_type(i, jnp.float32)], axis=-1)
  pairs = sharding.constrain(pairs, lead + (None, None))  # the one collective
  m, i = pairs[..., 0], jax.lax.bitcast_convert_type(pairs[..., 1], jnp.int32)
  part = _max_and_argmax(m)[1]  # the first slice holding the maximum (or a NaN)
  return part * width + jnp.take_along_axis(i, part[..., None], axis=-1)[..., 0]


def _max_and_argmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max, first index of the max or of the first NaN) over the last axis."""
  m = jnp.max(x, axis=-1, keepdims=True)
  hit = (x == m) | jnp.isnan(x)
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return m[..., 0], jnp.min(jnp.where(hit, idx, x.shape[-1] - 1), axis=-1)


def process_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """[..., V] logits -> float32 logits of the sampling distribution (-inf outside its support)."""
  x = logits.astype(jnp.float32)
  if cfg.greedy:
    return x
  x = x / cfg.temperature
  if cfg.top_k and cfg.top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)  # ties with the k-th value are kept, as in HF
  if cfg.nucleus:
    x = jnp.where(nucleus_keeps(x, cfg.drop_mass), x, -jnp.inf)
  return x


def nucleus_keeps(x: jax.Array, drop_mass) -> jax.Array:
  """bool[..., V]: the tokens top-p keeps in each row of `[..., V]` float32 logits.

  Top-p (transformers' TopPLogitsWarper) drops a token whose cumulative probability in ascending
  order, c(x_i) = the mass of the tokens at or below it, is <= drop_mass = 1 - top_p, and keeps
  the most likely token always. c rises with the token's probability, so the kept tokens are
  those at or above the least probability tau with c(tau) > drop_mass, and tau is found by
  bisection over the bit patterns of the probabilities (whose integer order is their order, as
  they are >= 0): 31 masked sums over the row instead of a sort, which on CPU costs 100x more.
  The predicate is transformers', with the mass of the tokens tied with a token counted with it
  (a sort would split them by position: ties at the cut keep all of them here). Under a mesh
  that splits the vocabulary each row is gathered once first, so the 31 sums stay on a device
  (each would otherwise be an all-reduce)."""
  p = jax.nn.softmax(x, axis=-1)
  if p.ndim >= 2:
    p = sharding.constrain(p, ("batch",) + (None,) * (p.ndim - 1))
  bits = jax.lax.bitcast_convert_type(p, jnp.int32)

  def cut_above(t):  # c(t) > drop_mass, for each row's candidate threshold t: int32[..., 1]
    return jnp.sum(jnp.where(bits <= t, p, 0.0), axis=-1, keepdims=True) > drop_mass

  def step(_, bounds):
    lo, hi = bounds  # cut_above(lo) is false, cut_above(hi) true
    mid = lo + (hi - lo) // 2
    above = cut_above(mid)
    return jnp.where(above, lo, mid), jnp.where(above, mid, hi)

  lo = jnp.full(bits.shape[:-1] + (1,), -1, jnp.int32)  # no token at or below: c = 0
  hi = jnp.max(bits, axis=-1, keepdims=True)  # every token: c = 1 > drop_mass
  _, hi = jax.lax.fori_loop(0, 31, step, (lo, hi))  # hi - lo <= 2^31 halves to 1
  return bits >= hi  # hi: tau's bits


def target_probs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """The target's sampling distribution p: float32[..., V]; one-hot argmax when greedy."""
  x = process_logits(logits, cfg)
  if cfg.greedy:
    return jax.nn.one_hot(argmax(x), x.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(x, axis=-1)


def sample(rng: jax.Array, logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """int32[...] one token per row of `[..., V]` logits (argmax when greedy)."""
  x = process_logits(logits, cfg)
  if cfg.greedy:
    return argmax(x)
  return jax.random.categorical(rng, x, axis=-1).astype(jnp.int32)


def row_keys(rng: jax.Array, batch: int) -> jax.Array:
  """One independent key per batch row: row b's stream does not depend on the batch size."""
  return jax.vmap(lambda b: jax.random.fold_in(rng, b))(jnp.arange(batch))


def draft_sample(rng: jax.Array, logits: jax.Array, cfg: SamplingConfig
                 ) -> tuple[jax.Array, jax.Array | None]:
  """A drafter's draw from its own `[B, V]` logits: (tokens int32[B], q float32[B, V] or None).

  Greedy decoding drafts the argmax deterministically (q None: verified by recursive rejection,
  which then reduces to matching the target's argmax). Otherwise the token is sampled from q =
  the drafter's distribution processed like the target's, and q is returned: the q-based rule
  needs exactly the distribution the token was drawn from, so the draw is made from log q itself.
  """
  if cfg.greedy:
    return argmax(logits), None
  q = target_probs(logits, cfg)
  keys = row_keys(rng, logits.shape[0])
  tokens = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, q)
  return tokens.astype(jnp.int32), q
