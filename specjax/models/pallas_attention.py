"""`attention_impl="pallas"`: the model's AttentionFn, backed by the tree-attention kernel.

`specjax.models.layers` calls the attention function once per layer for three kinds of step:

  * decode (T = 1) and tree verification (T = N + 1, `new_mask` the tree's ancestor-or-self
    relation) with a cache prefix: these go to `tree_attention`, the mask packed to bitwords;
  * prefill (T = padded prompt, causal `new_mask`, length 0): a bucket of at most
    `MAX_TREE_TOKENS` also goes to the kernel (a causal mask is a chain-shaped tree); longer
    prompts fall back to `xla_attention`, which is the right tool for a compute-bound T x T block;
  * no cache (`length=None`: training, `full_forward`): `xla_attention`.

Shapes the kernel cannot take (a head_dim that is not a power of two >= 16 on the GPU path, a
block longer than the cache) also fall back to XLA. On a CPU backend the kernel runs in Pallas
interpret mode, so `"pallas"` works everywhere; only on GPU/TPU is it fast.

`specjax.models.attention` lists this module as the lazy `"pallas"` entry of its registry: it is
imported on the first `get_attention_impl("pallas")`, so the rest of specjax never loads Pallas.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.tree_attention import pack_tree_mask, tree_attention
from specjax.models.xla_attention import xla_attention
from specjax.sharding import DATA, MODEL, tracing_mesh

MAX_TREE_TOKENS = 128  # longest block (tree + root, or prompt bucket) sent to the kernel


def kernel_applies(q, k, length) -> bool:
  """Whether `pallas_attention` uses the kernel for these shapes (else it uses XLA)."""
  t, d = q.shape[1], q.shape[3]
  backend = jax.default_backend()
  pow2_head = d >= 16 and not d & (d - 1)
  return (length is not None and t <= MAX_TREE_TOKENS and t <= k.shape[1]
          and (backend == "tpu" or pow2_head))


def _kernel(q, k, v, length, new_mask, sm_scale):
  return tree_attention(q, k, v, length, pack_tree_mask(new_mask), sm_scale=sm_scale,
                        interpret=jax.default_backend() == "cpu")


def _sharded_kernel(mesh, q, k, v, length, new_mask, sm_scale):
  """The kernel per device under `shard_map`: batch rows over `data`, query heads over `model`.

  A Pallas call is opaque to the partitioner (left alone it would be run replicated on gathered
  inputs), so each device runs it on its own rows and heads. KV heads follow the KV-head rule of
  `specjax.sharding`: split with the query heads when the model axis divides them; otherwise
  replicated, and each device slices out the one KV head its query heads share (the model axis
  is then a multiple of the KV heads). Heads that do not split that way stay whole.
  """
  b, _, h, _ = q.shape
  kv = k.shape[2]
  dp, tp = mesh.shape[DATA], mesh.shape[MODEL]
  rows = DATA if b % dp == 0 else None
  split_kv = kv % tp == 0
  heads = MODEL if h % tp == 0 and (split_kv or tp % kv == 0) else None
  kv_axis = MODEL if heads and split_kv else None
  group, local_heads = h // kv, h // tp

  def body(q, k, v, length, new_mask):
    if heads and not split_kv:  # this device's query heads all read KV head `first // group`
      first = jax.lax.axis_index(MODEL) * local_heads
      k = jax.lax.dynamic_slice_in_dim(k, first // group, 1, axis=2)
      v = jax.lax.dynamic_slice_in_dim(v, first // group, 1, axis=2)
    return _kernel(q, k, v, length, new_mask, sm_scale)

  qs, kvs = P(rows, None, heads, None), P(rows, None, kv_axis, None)
  return jax.shard_map(body, mesh=mesh, in_specs=(qs, kvs, kvs, P(rows), P(rows, None, None)),
                       out_specs=qs, check_vma=False)(q, k, v, length, new_mask)


def pallas_attention(q, k, v, length, new_mask, *, sm_scale):
  """AttentionFn: q [B, T, H, D], k/v [B, S, K, D], length int32[B] | None, new_mask [B, T, T].
  Traced under a device mesh (as `generate` traces on one), the kernel runs per device."""
  if not kernel_applies(q, k, length):
    return xla_attention(q, k, v, length, new_mask, sm_scale=sm_scale)
  mesh = tracing_mesh()
  if mesh is None or mesh.size == 1:
    return _kernel(q, k, v, length, new_mask, sm_scale)
  return _sharded_kernel(mesh, q, k, v, length, new_mask, sm_scale)
