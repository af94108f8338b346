"""The KV cache: an explicit pytree, updated functionally.

Layout (shape letters as in the package docstring):

  k, v:   [L, B, S, K, D]  keys / values of every layer, row and slot
  length: int32[B]         committed tokens per row; slots >= length are garbage, always masked

A forward pass over T new tokens writes their keys and values at slots `[length, length + T)`
without advancing `length`. `commit` then keeps a chosen subset of those T slots (the accepted
path of a draft tree), compacts it to `[length, length + n)` and advances `length` by n. Rolling
back a rejected draft is therefore nothing more than *not* advancing `length`.

On a device mesh the rows lie over `data` and the KV heads over `model` (`specjax.sharding`);
writes and commits are row-wise ops that keep that layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import sharding


@struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  length: jax.Array  # int32[B]

  @classmethod
  def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> KVCache:
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               length=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  def write(self, layer: int, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Writes `k_new, v_new: [B, T, K, D]` of one layer at slots `[length, length + T)`.

    The caller guarantees `length + T <= S` (generate sizes the cache so); writes past the end are
    dropped rather than wrapped, so a violation can never overwrite committed entries.
    """
    t = k_new.shape[1]
    slots = self.length[:, None] + jnp.arange(t)[None, :]  # [B, T]
    k = self.k.at[layer].set(_put_rows(self.k[layer], k_new.astype(self.k.dtype), slots))
    v = self.v.at[layer].set(_put_rows(self.v[layer], v_new.astype(self.v.dtype), slots))
    return self._pinned(k, v)

  def commit(self, keep: jax.Array, n_keep: jax.Array) -> KVCache:
    """Keeps slots `length + keep[b, :n_keep[b]]` of the last write and advances `length`.

    keep:   int32[B, T] indices into the last write (0 = the first new token), in path order.
    n_keep: int32[B] how many of them to keep (0 keeps nothing: the row does not advance).

    Entries are gathered into `[length, length + n_keep)` for every layer at once. Slots past the
    new length receive garbage, which is harmless: they are masked until overwritten.
    """
    t = keep.shape[1]
    src = self.length[:, None] + keep  # [B, T]
    dst = self.length[:, None] + jnp.arange(t)[None, :]  # [B, T]
    return self._pinned(_move_rows(self.k, src, dst), _move_rows(self.v, src, dst)).replace(
        length=self.length + n_keep.astype(jnp.int32))

  def _pinned(self, k: jax.Array, v: jax.Array) -> KVCache:
    """The cache with new k, v pinned to the cache layout on a mesh (`sharding.CACHE_AXES`)."""
    return self.replace(k=sharding.constrain(k, sharding.CACHE_AXES),
                        v=sharding.constrain(v, sharding.CACHE_AXES))

  def advance(self, n: jax.Array) -> KVCache:
    """Commits the first `n[b]` slots of the last write as they are (a chain or a prefill)."""
    return self.replace(length=self.length + n.astype(jnp.int32))


# Row-wise (vmapped) scatters and gathers: the batch is an explicit batching dimension of each
# op, so on a mesh whose `data` axis splits the rows every device updates its own rows in place
# (indexing with a broadcast `arange(B)` instead reads as a cross-row gather, and the
# partitioner would gather the cache to apply it).


@jax.vmap
def _put_rows(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
  """cache [B, S, K, D] with new [B, T, K, D] at slots [B, T]; slots past S are dropped."""
  return cache.at[slots].set(new, mode="drop")


def _move_rows(cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
  """cache [L, B, S, K, D] with, per row, slots src [B, T] copied to dst [B, T] in every layer."""
  def move(rows, src, dst):  # rows: [L, S, K, D] of one batch row
    return rows.at[:, dst].set(rows[:, src], mode="drop")
  return jax.vmap(move, in_axes=(1, 0, 0), out_axes=1)(cache, src, dst)
