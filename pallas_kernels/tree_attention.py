"""Tree attention for speculative verification: N tree queries over `[committed prefix | tree]`.

Query i sees cache slot j iff `j < length` (the committed prefix) or slot `j - length` holds an
ancestor-or-self of node i (the tree's own keys, written at slots `[length, length + N)`). N = 1
is ordinary decode attention. Shapes (letters as in `specjax`; G = H / K, M = N * G):

  q:         [B, N, H, D]   tree queries, already RoPE'd at their depth positions
  k_cache:   [B, S, K, D]   keys; slots >= length + N are never used (and, on GPU, never read)
  v_cache:   [B, S, K, D]
  length:    int32[B]       committed prefix per row; requires length + N <= S
  tree_mask: bool[B, N, N] ancestor-or-self (key on the last axis), or its packed form
             int32[B, N, W], W = ceil(N / 32): bit b of word w of row i is mask[i, 32 w + b]

The algorithm (Dao et al., Flash-Decoding 2023; FlashAttention-2 online softmax):

  * GQA grouping: the G query heads of one KV head, times the N tree rows, form the M rows of one
    matmul, so each KV block is read once per KV head (per `block_q` rows), not once per query.
  * Split-KV: the live slots `[0, length + N)` are cut into `num_splits` contiguous ranges of KV
    blocks, each range reduced by its own program to an unnormalised (acc, max, sum); the ranges
    are merged afterwards by log-sum-exp (`_merge_splits`), so a long prefix parallelises at B=1.
  * Blocks past `length + N` are skipped; inside the last block the mask hides the tail.

Two backends share the mask, the online-softmax step, the split plan and the merge:

  * GPU (Pallas Triton): grid (B, K, M blocks, splits); each program loops over its KV blocks with
    masked loads, so no slot past `length + N` is ever read from memory.
  * TPU (Pallas Mosaic): grid (B, M blocks, splits, blocks per split); the KV blocks are pipelined
    by BlockSpecs whose index maps read `length` from scalar prefetch (SMEM) and clamp to the
    split's last live block (a repeated block index issues no DMA); all K heads of a block are
    processed from one VMEM tile.

`interpret=True` (or a `pltpu.InterpretParams`) runs either path on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

Backend = Literal["gpu", "tpu"]

# Finite rather than -inf so the running max of a row that has seen nothing stays finite (no
# inf - inf = NaN); masked probabilities are zeroed explicitly, so this value never leaks.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_WORD_BITS = 32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the kernel. `for_backend` gives the defaults.

  block_q:    rows of the M = N * G (tree rows x grouped query heads) dimension per program;
              None = all of M in one block (rounded up to the backend's granule).
  block_kv:   cache slots per inner step (capped at S).
  num_splits: split-KV ranges per (row, KV head); None = enough programs to fill the device.
  num_warps, num_stages: Triton launch parameters (GPU only).
  """

  block_q: int | None = None
  block_kv: int = 64
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_kv", "num_warps", "num_stages"):
      if getattr(self, name) <= 0:
        raise ValueError(f"BlockSizes.{name} must be positive, got {getattr(self, name)}")
    for name in ("block_q", "num_splits"):
      value = getattr(self, name)
      if value is not None and value <= 0:
        raise ValueError(f"BlockSizes.{name} must be positive or None, got {value}")
    if self.block_kv % 8:
      raise ValueError(f"BlockSizes.block_kv must be a multiple of 8, got {self.block_kv}")
    if self.block_q is not None and self.block_q % 8:
      raise ValueError(f"BlockSizes.block_q must be a multiple of 8, got {self.block_q}")

  @classmethod
  def for_backend(cls, backend: Backend) -> BlockSizes:
    if backend == "gpu":  # [64 rows x 64 slots] scores + a [64, D] f32 accumulator per CTA
      return cls(block_q=64, block_kv=64, num_splits=None, num_warps=4, num_stages=2)
    if backend == "tpu":  # one [M, 512] score tile per head; 2 splits feed both megacore TCs
      return cls(block_q=256, block_kv=512, num_splits=2)
    raise ValueError(f"unknown backend {backend!r}; use 'gpu' or 'tpu'")


# ------------------------------------------------------------------------------------------------
# Public entry points


def pack_tree_mask(tree_mask: jax.Array) -> jax.Array:
  """bool[B, N, N] -> int32[B, N, ceil(N/32)]: bit b of word w of row i is mask[i, 32 w + b]."""
  b, n, _ = tree_mask.shape
  words = pl.cdiv(n, _WORD_BITS)
  bits = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, words * _WORD_BITS - n)))
  bits = bits.reshape(b, n, words, _WORD_BITS).astype(jnp.uint32)
  packed = jnp.sum(bits << jnp.arange(_WORD_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  return lax.bitcast_convert_type(packed, jnp.int32)


def unpack_tree_mask(packed: jax.Array, n: int) -> jax.Array:
  """int32[B, N, W] -> bool[B, N, N], the inverse of `pack_tree_mask`."""
  j = jnp.arange(n)
  words = jnp.take(packed, j // _WORD_BITS, axis=-1)  # [B, N, N]
  return ((words >> (j % _WORD_BITS)) & 1).astype(bool)


def tree_attention_reference(q, k_cache, v_cache, length, tree_mask, *, sm_scale):
  """The same maths in plain jnp, in float32 (HIGHEST matmul precision on every backend).

  A row that sees no slot at all returns zeros (the kernel does the same).
  """
  b, n, h, d = q.shape
  s, kv = k_cache.shape[1], k_cache.shape[2]
  mask = _as_bool_mask(tree_mask, n)
  rel = jnp.arange(s)[None, :] - length[:, None]  # [B, S] slot index inside the tree block
  in_tree = (rel >= 0) & (rel < n)
  sees_node = jnp.take_along_axis(
      mask, jnp.broadcast_to(jnp.clip(rel, 0, n - 1)[:, None, :], (b, n, s)), axis=2)
  visible = (rel < 0)[:, None, :] | (in_tree[:, None, :] & sees_node)  # [B, N, S]
  qg = q.astype(jnp.float32).reshape(b, n, kv, h // kv, d)
  scores = jnp.einsum("BNKGD,BSKD->BKGNS", qg, k_cache.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST) * sm_scale
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  total = jnp.sum(probs, axis=-1, keepdims=True)
  v = jnp.where(visible.any(axis=1)[:, :, None, None], v_cache.astype(jnp.float32), 0.0)
  out = jnp.einsum("BKGNS,BSKD->BNKGD", probs / jnp.where(total > 0, total, 1.0), v,
                   precision=lax.Precision.HIGHEST)
  return out.reshape(b, n, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret", "backend"))
def tree_attention(q, k_cache, v_cache, length, tree_mask, *, sm_scale: float,
                   block_sizes: BlockSizes | None = None, interpret=False,
                   backend: Backend | None = None):
  """Attention of N tree queries over the committed prefix plus their tree ancestors.

  Shapes in the module docstring. backend: "gpu" (Triton) or "tpu" (Mosaic); default from
  `jax.default_backend()`, and "gpu" on CPU (where `interpret` is required).
  Returns [B, N, H, D] in q's dtype.
  """
  backend = _resolve_backend(backend, interpret)
  packed = _validate(q, k_cache, v_cache, length, tree_mask, backend)
  sizes = block_sizes or BlockSizes.for_backend(backend)
  if backend == "gpu" and any(x is not None and x & (x - 1) for x in (sizes.block_q,
                                                                      sizes.block_kv)):
    raise ValueError(f"the GPU (Triton) kernel needs power-of-two block sizes, got {sizes}")
  b, n, h, d = q.shape
  kv = k_cache.shape[2]
  g = h // kv
  m = n * g
  block_q = _block_q(sizes, m, backend, q.dtype)
  m_pad = pl.cdiv(m, block_q) * block_q
  # [B, N, K, G, D] -> [B, K, M, D]: row r of KV head k is node r // G, query head k * G + r % G.
  qm = q.reshape(b, n, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, m, d)
  qm = jnp.pad(qm, ((0, 0), (0, 0), (0, m_pad - m), (0, 0)))
  # Each row's mask words, word-major: [B, W, M_pad, 1] (padded rows see the prefix only).
  words = jnp.repeat(packed.transpose(0, 2, 1), g, axis=2)
  words = jnp.pad(words, ((0, 0), (0, 0), (0, m_pad - m)))[..., None]
  length = length.astype(jnp.int32)
  call = _gpu_call if backend == "gpu" else _tpu_call
  acc, row_max, row_sum = call(qm, k_cache, v_cache, length, words, n=n, sm_scale=sm_scale,
                               sizes=sizes, block_q=block_q, interpret=interpret)
  out = _merge_splits(acc, row_max, row_sum)[:, :, :m]  # [B, K, M, D]
  out = out.reshape(b, kv, n, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n, h, d)
  return out.astype(q.dtype)


def kv_bytes_read(k_cache, length, n: int) -> int:
  """Bytes of K and V the kernel must read: the live slots `[0, length + N)` of every row."""
  _, s, kv, d = k_cache.shape
  live = sum(min(int(x) + n, s) for x in jax.device_get(length))
  return 2 * live * kv * d * jnp.dtype(k_cache.dtype).itemsize


# ------------------------------------------------------------------------------------------------
# Shared maths: the mask from packed words, the online-softmax step, the split plan, the merge


def _visible(slots, length, n: int, words):
  """bool[M, bk]: row r sees slot `slots[0, c]` (prefix, or a tree node whose bit r has set).

  slots: int32[1, bk]; words: W arrays int32[M, 1], word w covering tree nodes [32 w, 32 w + 32).
  """
  rel = slots - length  # position inside the tree block; negative = committed prefix
  word = words[0]
  for w in range(1, len(words)):  # W is static and small (N <= 32 W); selects, not a gather
    word = jnp.where(rel >= w * _WORD_BITS, words[w], word)
  bit = (word >> (rel & (_WORD_BITS - 1))) & 1
  return (rel < 0) | ((rel < n) & (bit != 0))


def _dot_precision(dtype, backend: Backend, interpret) -> lax.Precision | lax.DotAlgorithmPreset:
  """The kernel's matmul precision: f32-accurate products for float32 inputs on every path.

  HIGHEST (IEEE f32 on Triton, full-precision passes on Mosaic; a no-op for bf16 inputs), except
  compiled float32 on the GPU: there IEEE f32 means FMA loops without tensor cores (on an H200,
  N = 64 over a 32k-slot cache: 50.6 ms with IEEE dots, 2.4 ms with TF32 passes, 0.9 ms for XLA's
  attention), so the dots run as three TF32 passes on tensor cores (split operands; max error
  8e-8 against the reference there). Interpret mode keeps HIGHEST: the CPU has no TF32.
  """
  if backend == "gpu" and not interpret and jnp.dtype(dtype) == jnp.float32:
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return lax.Precision.HIGHEST


def _online_softmax_step(q, k, v, visible, carry, sm_scale: float, precision):
  """FlashAttention-2 update of (running max, running sum, unnormalised acc) by one KV block.

  q: [M, D]; k, v: [bk, D]; visible: bool[M, bk]; carry: f32 [M, 1], [M, 1], [M, D];
  precision: `_dot_precision`'s.
  """
  row_max, row_sum, acc = carry
  scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32) * sm_scale
  scores = jnp.where(visible, scores, _MASK_VALUE)
  new_max = jnp.maximum(row_max, jnp.max(scores, axis=1)[:, None])
  rescale = jnp.exp(row_max - new_max)
  probs = jnp.where(visible, jnp.exp(scores - new_max), 0.0)
  row_sum = rescale * row_sum + jnp.sum(probs, axis=1)[:, None]
  pv = lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       precision=precision, preferred_element_type=jnp.float32)
  return new_max, row_sum, rescale * acc + pv


def _split_plan(length, n: int, seq_len: int, block_kv: int, num_splits: int, split):
  """(live, lo, hi): slots `[0, live)` are read; this split owns KV blocks `[lo, hi)`.

  The live range is divided evenly among the splits at run time, so every split gets work
  whatever the length; blocks entirely past `length + N` belong to no split.
  """
  live = jnp.minimum(length + n, seq_len)
  num_blocks = lax.div(live + block_kv - 1, block_kv)
  per_split = lax.div(num_blocks + num_splits - 1, num_splits)
  lo = jnp.minimum(split * per_split, num_blocks)
  return live, lo, jnp.minimum(lo + per_split, num_blocks)


def _merge_splits(acc, row_max, row_sum):
  """Log-sum-exp merge over the split axis 1: acc [B, P, K, M, D], max/sum [B, P, K, M, 1]."""
  global_max = jnp.max(row_max, axis=1, keepdims=True)
  weight = jnp.exp(row_max - global_max)  # 0 for splits that saw nothing (max = _MASK_VALUE)
  total = jnp.sum(weight * row_sum, axis=1)
  out = jnp.sum(weight * acc, axis=1)
  return out / jnp.where(total > 0, total, 1.0)  # a row that saw nothing stays 0


def _init_carry(rows: int, d: int):
  return (jnp.full((rows, 1), _MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))


def _num_splits(sizes: BlockSizes, seq_len: int, block_kv: int, programs: int,
                backend: Backend) -> int:
  if sizes.num_splits is not None:
    return min(sizes.num_splits, pl.cdiv(seq_len, block_kv))
  if backend == "tpu":
    return 1
  target = 2 * _gpu_core_count()  # two CTAs per SM hide the load latency of the other
  return max(1, min(pl.cdiv(target, programs), pl.cdiv(seq_len, block_kv)))


def _gpu_core_count() -> int:
  device = jax.devices()[0]
  return getattr(device, "core_count", None) or 132  # 132 SMs: H100 / H200


def _cost_estimate(inputs, out_shape, *, rows: int, seq_len: int,
                   head_dim: int) -> pl.CostEstimate:
  """What XLA's scheduler is told the call costs (it cannot see inside a kernel).

  Shapes are static, so all S slots stand in for the live `length + N` (an upper bound): two
  matmuls of [rows, D] x [D, S] and [rows, S] x [S, D], one exp per score; rows = B * K * M_pad.
  Bytes: every input and output array once. Mosaic hands it to XLA; jax's Triton lowering
  currently ignores it, and the GPU call sets it anyway so that it counts once that changes.
  """
  nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (*inputs, *out_shape))
  return pl.CostEstimate(flops=4 * rows * seq_len * head_dim, transcendentals=rows * seq_len,
                         bytes_accessed=nbytes)


def _partials_shape(b, splits, kv, m_pad, d):
  return (jax.ShapeDtypeStruct((b, splits, kv, m_pad, d), jnp.float32),
          jax.ShapeDtypeStruct((b, splits, kv, m_pad, 1), jnp.float32),
          jax.ShapeDtypeStruct((b, splits, kv, m_pad, 1), jnp.float32))


# ------------------------------------------------------------------------------------------------
# GPU: Pallas Triton


def _gpu_kernel(len_ref, q_ref, k_ref, v_ref, words_ref, acc_ref, max_ref, sum_ref, *,
                n: int, sm_scale: float, block_kv: int, num_splits: int, seq_len: int,
                precision):
  # q_ref [bq, D]; k_ref, v_ref [S, D] of this (row, KV head); words_ref [W, bq, 1];
  # acc_ref [bq, D], max_ref, sum_ref [bq, 1]: this split's unnormalised partials.
  length = len_ref[pl.program_id(0)]
  live, lo, hi = _split_plan(length, n, seq_len, block_kv, num_splits, pl.program_id(3))
  q = q_ref[...]
  words = [words_ref[w] for w in range(words_ref.shape[0])]
  d = q.shape[1]

  def body(block, carry):
    start = block * block_kv
    # The last block is shifted back to end at S (no out-of-bounds slice); the slots it repeats
    # (< start) are masked, as are slots >= live: a masked load touches no memory for them.
    first = jnp.minimum(start, seq_len - block_kv)
    col = first + jnp.arange(block_kv)[:, None]
    fresh_col = jnp.broadcast_to((col >= start) & (col < live), (block_kv, d))
    k = plgpu.load(k_ref.at[pl.ds(first, block_kv), :], mask=fresh_col, other=0.0)
    v = plgpu.load(v_ref.at[pl.ds(first, block_kv), :], mask=fresh_col, other=0.0)
    row = first + jnp.arange(block_kv)[None, :]
    visible = _visible(row, length, n, words) & (row >= start)
    return _online_softmax_step(q, k, v, visible, carry, sm_scale, precision)

  row_max, row_sum, acc = lax.fori_loop(lo, hi, body, _init_carry(q.shape[0], d))
  acc_ref[...] = acc
  max_ref[...] = row_max
  sum_ref[...] = row_sum


def _gpu_call(qm, k_cache, v_cache, length, words, *, n, sm_scale, sizes, block_q, interpret):
  b, kv, m_pad, d = qm.shape
  s = k_cache.shape[1]
  if s < 16:  # Triton's dot needs >= 16 rows; caches this small are cheap to pad
    pad = ((0, 0), (0, 16 - s), (0, 0), (0, 0))
    k_cache, v_cache, s = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), 16
  block_kv = min(sizes.block_kv, 1 << (s.bit_length() - 1))  # a power of two <= S
  num_q = m_pad // block_q
  splits = _num_splits(sizes, s, block_kv, b * kv * num_q, "gpu")
  num_words = words.shape[1]
  kernel = functools.partial(_gpu_kernel, n=n, sm_scale=sm_scale, block_kv=block_kv,
                             num_splits=splits, seq_len=s,
                             precision=_dot_precision(qm.dtype, "gpu", interpret))
  partial_spec = pl.BlockSpec((None, None, None, block_q, 1), lambda i, j, r, p: (i, p, j, r, 0))
  inputs = (length, qm, k_cache, v_cache, words)
  out_shape = _partials_shape(b, splits, kv, m_pad, d)
  return pl.pallas_call(
      kernel,
      grid=(b, kv, num_q, splits),
      in_specs=[
          pl.BlockSpec((b,), lambda i, j, r, p: (0,)),  # length, read as a scalar
          pl.BlockSpec((None, None, block_q, d), lambda i, j, r, p: (i, j, r, 0)),
          pl.BlockSpec((None, s, None, d), lambda i, j, r, p: (i, 0, j, 0)),
          pl.BlockSpec((None, s, None, d), lambda i, j, r, p: (i, 0, j, 0)),
          pl.BlockSpec((None, num_words, block_q, 1), lambda i, j, r, p: (i, 0, r, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, block_q, d), lambda i, j, r, p: (i, p, j, r, 0)),
          partial_spec, partial_spec,
      ],
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps,
                                           num_stages=sizes.num_stages),
      interpret=interpret,
      name="tree_attention_gpu",
      cost_estimate=_cost_estimate(inputs, out_shape, rows=b * kv * m_pad, seq_len=s,
                                   head_dim=d),
  )(*inputs)


# ------------------------------------------------------------------------------------------------
# TPU: Pallas Mosaic


def _tpu_kernel(len_ref, q_ref, k_ref, v_ref, words_ref, acc_ref, max_ref, sum_ref,
                acc_scratch, max_scratch, sum_scratch, *, n: int, sm_scale: float,
                block_kv: int, num_splits: int, seq_len: int, num_kv_heads: int, precision):
  # len_ref: SMEM int32[B]; q_ref [K, bq, D]; k_ref, v_ref [bk, K * D] (all heads of one KV
  # block); words_ref [W, bq, 1]; outputs [K, bq, D] / [K, bq, 1]; scratch alike.
  step = pl.program_id(3)
  length = len_ref[pl.program_id(0)]
  live, lo, hi = _split_plan(length, n, seq_len, block_kv, num_splits, pl.program_id(2))
  d = q_ref.shape[2]

  @pl.when(step == 0)
  def _init():
    init_max, init_sum, init_acc = _init_carry(q_ref.shape[1], d)
    for h in range(num_kv_heads):
      max_scratch[h], sum_scratch[h], acc_scratch[h] = init_max, init_sum, init_acc

  @pl.when(lo + step < hi)
  def _compute():
    start = (lo + step) * block_kv
    row = start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    col = start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
    # The block's tail past `live` (or past S in a partial last block) holds stale or undefined
    # values: zero V there so that 0 * NaN cannot reach the accumulator.
    live_col = col < live
    visible = _visible(row, length, n, [words_ref[w] for w in range(words_ref.shape[0])])
    visible &= row < live
    for h in range(num_kv_heads):  # static: every head of this VMEM tile, one DMA for all
      k = k_ref[:, h * d:(h + 1) * d]
      v = jnp.where(live_col, v_ref[:, h * d:(h + 1) * d], 0).astype(v_ref.dtype)
      carry = (max_scratch[h], sum_scratch[h], acc_scratch[h])
      max_scratch[h], sum_scratch[h], acc_scratch[h] = _online_softmax_step(
          q_ref[h], k, v, visible, carry, sm_scale, precision)

  @pl.when(step == pl.num_programs(3) - 1)
  def _finish():
    acc_ref[...] = acc_scratch[...]
    max_ref[...] = max_scratch[...]
    sum_ref[...] = sum_scratch[...]


def _tpu_call(qm, k_cache, v_cache, length, words, *, n, sm_scale, sizes, block_q, interpret):
  b, kv, m_pad, d = qm.shape
  s = k_cache.shape[1]
  block_kv = min(sizes.block_kv, s)  # == S is a full-dimension block, always a legal tile
  num_q = m_pad // block_q
  splits = _num_splits(sizes, s, block_kv, b * num_q, "tpu")
  steps = pl.cdiv(pl.cdiv(s, block_kv), splits)  # static bound on a split's blocks
  num_words = words.shape[1]

  def kv_index(i, r, p, t, len_ref):
    # Clamp to the split's last live block: steps past it repeat the block index, which the
    # pipeline recognises and does not copy again (and the kernel skips the compute).
    _, lo, hi = _split_plan(len_ref[i], n, s, block_kv, splits, p)
    return i, jnp.maximum(jnp.minimum(lo + t, hi - 1), 0), 0

  kernel = functools.partial(_tpu_kernel, n=n, sm_scale=sm_scale, block_kv=block_kv,
                             num_splits=splits, seq_len=s, num_kv_heads=kv,
                             precision=_dot_precision(qm.dtype, "tpu", interpret))
  kv_spec = pl.BlockSpec((None, block_kv, kv * d), kv_index)
  partial_spec = pl.BlockSpec((None, None, kv, block_q, 1), lambda i, r, p, t, _: (i, p, 0, r, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, num_q, splits, steps),
      in_specs=[
          pl.BlockSpec((None, kv, block_q, d), lambda i, r, p, t, _: (i, 0, r, 0)),
          kv_spec, kv_spec,
          pl.BlockSpec((None, num_words, block_q, 1), lambda i, r, p, t, _: (i, 0, r, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, kv, block_q, d), lambda i, r, p, t, _: (i, p, 0, r, 0)),
          partial_spec, partial_spec,
      ],
      scratch_shapes=[pltpu.VMEM((kv, block_q, d), jnp.float32),
                      pltpu.VMEM((kv, block_q, 1), jnp.float32),
                      pltpu.VMEM((kv, block_q, 1), jnp.float32)],
  )
  # [B, S, K, D] -> [B, S, K * D] is free (row-major) and makes a KV block one 2-D VMEM tile.
  k2, v2 = k_cache.reshape(b, s, kv * d), v_cache.reshape(b, s, kv * d)
  inputs = (length, qm, k2, v2, words)
  out_shape = _partials_shape(b, splits, kv, m_pad, d)
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="tree_attention_tpu",
      cost_estimate=_cost_estimate(inputs, out_shape, rows=b * kv * m_pad, seq_len=s,
                                   head_dim=d),
  )(*inputs)


# ------------------------------------------------------------------------------------------------
# Input handling


def _resolve_backend(backend, interpret) -> Backend:
  """An explicit backend is taken as given (ahead-of-time lowering for another platform works);
  the default follows `jax.default_backend()`, the GPU path on CPU, where only interpret runs."""
  if backend is None:
    platform = jax.default_backend()
    if platform not in ("gpu", "tpu") and not interpret:
      raise ValueError(f"no Pallas backend on {platform!r}: pass interpret=True")
    backend = "tpu" if platform == "tpu" else "gpu"
  if backend not in ("gpu", "tpu"):
    raise ValueError(f"unknown backend {backend!r}; use 'gpu' or 'tpu'")
  return backend


def _block_q(sizes: BlockSizes, m: int, backend: Backend, dtype) -> int:
  if backend == "gpu":  # Triton: power-of-two tiles, and its dot needs M >= 16
    full = max(16, 1 << (m - 1).bit_length())
    return full if sizes.block_q is None else min(full, max(16, sizes.block_q))
  granule = 8 * 4 // jnp.dtype(dtype).itemsize  # sublanes: 8 rows of 32 bits, 16 of bf16
  full = pl.cdiv(m, granule) * granule
  if sizes.block_q is None:
    return full
  return min(full, pl.cdiv(sizes.block_q, granule) * granule)


def _as_bool_mask(tree_mask, n: int):
  return tree_mask if tree_mask.dtype == jnp.bool_ else unpack_tree_mask(tree_mask, n)


def _validate(q, k_cache, v_cache, length, tree_mask, backend: Backend):
  """Checks shapes and dtypes; returns the packed mask int32[B, N, W]."""
  if q.ndim != 4 or k_cache.ndim != 4:
    raise ValueError(f"q must be [B, N, H, D] and k_cache [B, S, K, D]; got {q.shape}, "
                     f"{k_cache.shape}")
  b, n, h, d = q.shape
  if v_cache.shape != k_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
    raise ValueError(f"k_cache / v_cache must be [B={b}, S, K, D={d}] alike; got "
                     f"{k_cache.shape}, {v_cache.shape}")
  s, kv = k_cache.shape[1], k_cache.shape[2]
  if h % kv:
    raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kv})")
  if n > s:
    raise ValueError(f"the tree ({n} nodes) does not fit the cache ({s} slots)")
  if length.shape != (b,) or not jnp.issubdtype(length.dtype, jnp.integer):
    raise ValueError(f"length must be int[{b}], got {length.dtype}{list(length.shape)}")
  if not q.dtype == k_cache.dtype == v_cache.dtype or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k_cache.dtype}, "
                     f"{v_cache.dtype}")
  if backend == "gpu" and (d < 16 or d & (d - 1)):
    raise ValueError(f"the GPU (Triton) kernel needs a power-of-two head_dim >= 16, got {d}")
  words = pl.cdiv(n, _WORD_BITS)
  if tree_mask.dtype == jnp.bool_:
    if tree_mask.shape != (b, n, n):
      raise ValueError(f"a bool tree_mask must be [B, N, N] = {(b, n, n)}, got {tree_mask.shape}")
    return pack_tree_mask(tree_mask)
  if tree_mask.dtype not in (jnp.int32, jnp.uint32) or tree_mask.shape != (b, n, words):
    raise ValueError(f"a packed tree_mask must be int32[B, N, ceil(N/32)] = {(b, n, words)}, "
                     f"got {tree_mask.dtype}{list(tree_mask.shape)}")
  return lax.bitcast_convert_type(tree_mask, jnp.int32)
