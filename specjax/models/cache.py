"""The KV cache: an explicit pytree, updated functionally.

Layout (shape letters as in the package docstring):

  k, v:   L arrays [B, S, K, D]  keys / values of each layer's rows and slots
  length: int32[B]               committed tokens per row; slots >= length are garbage, masked

One buffer per layer, not one [L, B, S, K, D] array: a layer's write then updates its own buffer
in place inside the compiled decode loop, where writing one layer of a stacked array copied all L
layers' K and V at every layer of every step.

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
  k: tuple[jax.Array, ...]  # L x [B, S, K, D]
  v: tuple[jax.Array, ...]  # L x [B, S, K, D]
  length: jax.Array  # int32[B]

  @classmethod
  def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> KVCache:
    shape = (batch, max_len, num_kv_heads, head_dim)
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               length=jnp.zeros((batch,), jnp.int32))

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  def stacked(self) -> tuple[jax.Array, jax.Array]:
    """(k, v) as [L, B, S, K, D] arrays (a copy: for inspecting, not for the decode loop)."""
    return jnp.stack(self.k), jnp.stack(self.v)

  def write(self, layer: int, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Writes `k_new, v_new: [B, T, K, D]` of one layer at slots `[length, length + T)`.

    The caller guarantees `length + T <= S` (generate sizes the cache so); writes past the end are
    dropped rather than wrapped, so a violation can never overwrite committed entries.
    """
    t = k_new.shape[1]
    slots = self.length[:, None] + jnp.arange(t)[None, :]  # [B, T]
    k, v = list(self.k), list(self.v)
    k[layer] = _put_rows(k[layer], k_new.astype(k[layer].dtype), slots)
    v[layer] = _put_rows(v[layer], v_new.astype(v[layer].dtype), slots)
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
    return self._pinned([_move_rows(a, src, dst) for a in self.k],
                        [_move_rows(a, src, dst) for a in self.v]).replace(
        length=self.length + n_keep.astype(jnp.int32))

  def _pinned(self, k: list[jax.Array], v: list[jax.Array]) -> KVCache:
    """The cache with new per-layer k, v pinned to the cache layout on a mesh
    (`sharding.CACHE_AXES`)."""
    return self.replace(k=tuple(sharding.constrain(a, sharding.CACHE_AXES) for a in k),
                        v=tuple(sharding.constrain(a, sharding.CACHE_AXES) for a in v))

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


@jax.vmap
def _move_rows(cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
  """One layer's cache [B, S, K, D] with, per row, slots src [B, T] copied to dst [B, T]."""
  return cache.at[dst].set(cache[src], mode="drop")
