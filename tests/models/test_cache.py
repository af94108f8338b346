"""`KVCache` write / commit / advance, checked slot by slot on small random caches.

These are exact data movements (no arithmetic), so every comparison is bitwise.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.cache import KVCache

L, B, S, K, D = 3, 3, 16, 2, 4


def _random_cache(lengths, seed=0) -> KVCache:
  """A cache whose every slot holds distinct random values (so any stray move is visible)."""
  rng = np.random.default_rng(seed)

  def layers():
    return tuple(jnp.asarray(rng.normal(size=(B, S, K, D)), jnp.float32) for _ in range(L))
  return KVCache(k=layers(), v=layers(), length=jnp.asarray(lengths, jnp.int32))


def _new_kv(t, seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(B, t, K, D)), jnp.float32),
          jnp.asarray(rng.normal(size=(B, t, K, D)), jnp.float32))


def test_init_shapes():
  """`KVCache.init` allocates one [B, S, K, D] buffer of zeros per layer for k and for v, in the
  asked dtype, with length 0 per row; `stacked` gives them as [L, B, S, K, D]."""
  c = KVCache.init(L, B, S, K, D, jnp.bfloat16)
  assert len(c.k) == len(c.v) == c.num_layers == L
  assert all(a.shape == (B, S, K, D) and a.dtype == jnp.bfloat16 for a in c.k + c.v)
  assert len({id(a) for a in c.k + c.v}) == 2 * L  # distinct buffers, each updated in place
  assert c.max_len == S and c.batch == B
  assert all(a.shape == (L, B, S, K, D) for a in c.stacked())
  np.testing.assert_array_equal(c.length, np.zeros(B))


def test_write_at_ragged_lengths_touches_only_its_slots():
  """`write(layer, k, v)` of T=4 tokens at ragged lengths [0, 5, 9] fills exactly slots
  [length, length + 4) of that layer in each row; committed slots (< length), later slots, other
  layers and `length` itself are untouched. Why: a write that touches the committed prefix would
  silently corrupt every later token."""
  lengths = np.array([0, 5, 9])
  c = _random_cache(lengths)
  k_new, v_new = _new_kv(4)
  out = c.write(1, k_new, v_new)
  np.testing.assert_array_equal(out.length, lengths)
  for old, new, val in ((c.k, out.k, k_new), (c.v, out.v, v_new)):
    old, new, val = np.asarray(old), np.asarray(new), np.asarray(val)
    expect = old.copy()
    for b, n in enumerate(lengths):
      expect[1, b, n:n + 4] = val[b]
    np.testing.assert_array_equal(new, expect)


def test_write_past_the_end_is_dropped_not_wrapped():
  """A write that would run past S drops the overflow: no wrap-around onto committed slots."""
  lengths = np.array([14, 0, 16])
  c = _random_cache(lengths)
  k_new, v_new = _new_kv(4)
  out = c.write(0, k_new, v_new)
  expect = np.asarray(c.k).copy()
  expect[0, 0, 14:16] = np.asarray(k_new)[0, :2]
  expect[0, 1, 0:4] = np.asarray(k_new)[1]
  np.testing.assert_array_equal(out.k, expect)


def test_commit_gathered_path_compacts_every_layer():
  """After a write of 4 at lengths [3, 0, 7], `commit(keep=[0, 2, 3], n_keep=3)` moves exactly
  entries 0, 2, 3 of the write to [length, length + 3) in every layer (k and v), leaves committed
  slots alone and advances length by 3. Why: this is how an accepted draft-tree path (whose nodes
  sit in non-contiguous slots) becomes the committed prefix."""
  lengths = np.array([3, 0, 7])
  c = _random_cache(lengths)
  for layer in range(L):
    k_new, v_new = _new_kv(4, seed=10 + layer)
    c = c.write(layer, k_new, v_new)
  keep = jnp.asarray([[0, 2, 3]] * B, jnp.int32)
  out = c.commit(keep, jnp.full((B,), 3, jnp.int32))
  np.testing.assert_array_equal(out.length, lengths + 3)
  for old, new in ((c.k, out.k), (c.v, out.v)):
    old, new = np.asarray(old), np.asarray(new)
    for b, n in enumerate(lengths):
      np.testing.assert_array_equal(new[:, b, :n], old[:, b, :n])
      np.testing.assert_array_equal(new[:, b, n:n + 3], old[:, b, [n, n + 2, n + 3]])


def test_commit_ragged_n_keep_and_zero():
  """Per-row `n_keep` [2, 0, 1]: each row advances by its own count and gets its own path; the row
  with n_keep = 0 keeps its length and committed slots (slots >= length are scratch by contract,
  so they are not compared)."""
  lengths = np.array([4, 6, 2])
  c = _random_cache(lengths)
  keep = np.array([[1, 3, 0], [2, 1, 0], [3, 0, 0]])
  out = c.commit(jnp.asarray(keep, jnp.int32), jnp.asarray([2, 0, 1], jnp.int32))
  np.testing.assert_array_equal(out.length, [6, 6, 3])
  old, new = np.asarray(c.k), np.asarray(out.k)
  for b, (n, m) in enumerate(zip(lengths, [2, 0, 1])):
    np.testing.assert_array_equal(new[:, b, :n], old[:, b, :n])
    np.testing.assert_array_equal(new[:, b, n:n + m], old[:, b, n + keep[b, :m]])


def test_commit_identity_path_equals_advance():
  """Keeping the first n slots in order (a chain) is the same as `advance(n)`, bit for bit."""
  c = _random_cache([1, 5, 8])
  n = jnp.asarray([4, 2, 0], jnp.int32)
  a = c.commit(jnp.tile(jnp.arange(4, dtype=jnp.int32), (B, 1)), n)
  b = c.advance(n)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_jit_donation_reuses_cache_buffers():
  """`jax.jit(..., donate_argnums=0)` over a cache-updating step donates the old cache: every
  layer's k/v buffers are deleted after the call (no second copy lives on), and the result is the
  same as without donation. Why: on an accelerator the cache dominates memory; generate relies on
  updating it in place."""

  def step(cache, k_new, v_new):
    cache = cache.write(0, k_new, v_new).write(1, k_new * 2, v_new * 2)
    return cache.commit(jnp.asarray([[0, 2]] * B, jnp.int32), jnp.full((B,), 2, jnp.int32))

  k_new, v_new = _new_kv(3)
  expect = jax.jit(step)(_random_cache([0, 3, 6]), k_new, v_new)
  cache = _random_cache([0, 3, 6])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = jax.jit(step, donate_argnums=0)(cache, k_new, v_new)
    jax.block_until_ready(out)
  unusable = [w for w in caught if "donated buffers were not usable" in str(w.message)]
  if unusable and not cache.k[0].is_deleted():
    pytest.skip(f"backend {jax.default_backend()} does not support donation: {unusable[0].message}")
  assert all(a.is_deleted() for a in cache.k + cache.v)
  assert not k_new.is_deleted()  # only the donated argument is consumed
  for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(expect)):
    np.testing.assert_array_equal(x, y)
