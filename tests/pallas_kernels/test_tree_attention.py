"""`tree_attention` (Pallas) against `tree_attention_reference` (plain jnp).

Layout follows jax's pallas/ops tests: one set of cases in `_Cases`, run by subclasses that pick
the backend path and the execution mode. `TestInterpretGpu` / `TestInterpretTpu` run the Triton
and Mosaic kernels in Pallas interpret mode on CPU (always); `TestGpu` / `TestTpu` compile them
for the real device and skip cleanly elsewhere.

Tolerance policy (max |kernel - reference| <= tol * max(1, max |reference|), reference in f32):
  * float32:  1e-5 — both sides accumulate in f32; only the summation order differs
    (blockwise online softmax and the split merge vs one softmax).
  * bfloat16: 2e-2 — the kernel rounds probabilities to bf16 before the P.V matmul (as the XLA
    model path does) and rounds the output to bf16: a few bf16 ulps (2^-8 = 3.9e-3 each).
Never loosen these to make a case pass: a bigger error is a bug.

The grid samples every listed value of each axis (B in {1, 3}; N in {1, 7, 32, 64}; S from N to a
few thousand; lengths ragged, including 0 and S - N; MHA / GQA / MQA; D in {64, 128}; f32 / bf16)
rather than their product, to stay within the CI time budget in interpret mode.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import (
  BlockSizes,
  pack_tree_mask,
  tree_attention,
  tree_attention_reference,
  unpack_tree_mask,
)
from pallas_kernels.bench import random_tree_mask

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_inputs(seed, b, n, h, kv, d, s, lengths, dtype, poison=True):
  """Random q / k / v with the tree's mask; slots >= length + N hold NaN when `poison`."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, n, h, d)).astype(np.float32)
  k = rng.standard_normal((b, s, kv, d)).astype(np.float32)
  v = rng.standard_normal((b, s, kv, d)).astype(np.float32)
  if poison:  # the kernel must never use a slot past length + N
    for row, length in enumerate(lengths):
      k[row, length + n:] = np.nan
      v[row, length + n:] = np.nan
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(lengths, jnp.int32), jnp.asarray(random_tree_mask(rng, b, n)))


def assert_close(out, ref, dtype):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out).all()
  tol = TOLERANCE[dtype] * max(1.0, float(np.abs(ref).max()))
  np.testing.assert_allclose(out, ref, rtol=0, atol=tol)


# (B, N, H, K, D, S, lengths, dtype): every value of every axis appears at least once.
CASES = [
    (1, 1, 8, 8, 64, 1, [0], jnp.float32),  # decode, S == N, empty prefix, MHA
    (3, 1, 8, 2, 128, 300, [0, 150, 299], jnp.bfloat16),  # decode over a ragged batch, GQA
    (1, 7, 8, 1, 64, 7, [0], jnp.bfloat16),  # S == N: the tree alone, MQA
    (3, 7, 4, 2, 128, 520, [513, 0, 260], jnp.float32),  # length = S - N in row 0
    (1, 32, 4, 4, 128, 2500, [2468], jnp.float32),  # long prefix, S - N
    (3, 32, 8, 2, 64, 200, [100, 168, 0], jnp.bfloat16),
    (1, 64, 4, 1, 64, 3000, [1777], jnp.bfloat16),  # MQA: M = 256 rows per KV head
    (3, 64, 2, 2, 128, 64, [0, 0, 0], jnp.float32),  # S == N == 64, MHA
    (1, 65, 4, 2, 64, 200, [100], jnp.float32),  # a 64-node tree plus its root: 3 mask words
]


def _case_id(case):
  b, n, h, kv, d, s, lengths, dtype = case
  return f"B{b}-N{n}-H{h}K{kv}-D{d}-S{s}-L{'_'.join(map(str, lengths))}-{jnp.dtype(dtype).name}"


class _Cases:
  backend: str
  interpret: bool

  def run(self, q, k, v, length, mask, *, sm_scale, block_sizes=None):
    return tree_attention(q, k, v, length, mask, sm_scale=sm_scale, block_sizes=block_sizes,
                          interpret=self.interpret, backend=self.backend)

  @pytest.mark.parametrize("case", CASES, ids=_case_id)
  def test_matches_reference(self, case):
    b, n, h, kv, d, s, lengths, dtype = case
    q, k, v, length, mask = make_inputs(0, b, n, h, kv, d, s, lengths, dtype)
    out = self.run(q, k, v, length, mask, sm_scale=d**-0.5)
    ref = tree_attention_reference(q, k, v, length, mask, sm_scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype)

  @pytest.mark.parametrize("sizes", [
      BlockSizes(block_q=16, block_kv=16, num_splits=1),  # one split walks every block
      BlockSizes(block_q=16, block_kv=32, num_splits=5),  # several M blocks, uneven splits
      BlockSizes(block_q=32, block_kv=64, num_splits=64),  # more splits than live blocks
  ], ids=["split1", "split5", "split64"])
  def test_block_sizes_do_not_change_the_result(self, sizes):
    q, k, v, length, mask = make_inputs(1, 2, 9, 8, 2, 64, 333, [0, 300], jnp.float32)
    out = self.run(q, k, v, length, mask, sm_scale=0.125, block_sizes=sizes)
    ref = tree_attention_reference(q, k, v, length, mask, sm_scale=0.125)
    assert_close(out, ref, jnp.float32)

  def test_packed_mask_and_row_that_sees_nothing(self):
    q, k, v, length, mask = make_inputs(2, 2, 5, 4, 2, 64, 40, [0, 17], jnp.float32)
    mask = mask.at[0, 3].set(False)  # no prefix (length 0) and no node: an empty row
    out = self.run(q, k, v, length, pack_tree_mask(mask), sm_scale=0.125)
    ref = tree_attention_reference(q, k, v, length, mask, sm_scale=0.125)
    assert_close(out, ref, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[0, 3]), 0.0)


class TestInterpretGpu(_Cases):
  """The Triton kernel in interpret mode (CPU)."""

  backend, interpret = "gpu", True


class TestInterpretTpu(_Cases):
  """The Mosaic kernel in interpret mode (CPU)."""

  backend, interpret = "tpu", True


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGpu(_Cases):
  backend, interpret = "gpu", False


@pytest.mark.tpu
@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
class TestTpu(_Cases):
  backend, interpret = "tpu", False


# ------------------------------------------------------------------------------------------------
# The reference by hand, the mask encoding, lowering for the real backends, input validation


def test_reference_on_a_case_worked_by_hand():
  # One row, one head, D = 1, sm_scale = 1, length = 1; a chain of N = 2 nodes at slots 1, 2 and
  # a slot 3 past length + N whose huge key must be ignored.
  #   keys   k = [0, ln 2, ln 3, 50]      values v = [3, 6, 9, 1000]      queries q = [1, 1]
  #   node 0 sees slots {0 (prefix), 1 (itself)}: weights e^0 : e^ln2 = 1 : 2
  #       -> (1 * 3 + 2 * 6) / 3 = 5
  #   node 1 sees slots {0, 1 (its parent), 2 (itself)}: weights 1 : 2 : 3
  #       -> (1 * 3 + 2 * 6 + 3 * 9) / 6 = 7
  k = jnp.array([0.0, np.log(2.0), np.log(3.0), 50.0]).reshape(1, 4, 1, 1)
  v = jnp.array([3.0, 6.0, 9.0, 1000.0]).reshape(1, 4, 1, 1)
  q = jnp.ones((1, 2, 1, 1))
  mask = jnp.array([[[True, False], [True, True]]])
  out = tree_attention_reference(q, k, v, jnp.array([1]), mask, sm_scale=1.0)
  np.testing.assert_allclose(np.asarray(out).ravel(), [5.0, 7.0], rtol=1e-6)


def test_pack_unpack_round_trip():
  mask = jnp.asarray(np.random.default_rng(3).random((2, 70, 70)) < 0.5)
  packed = pack_tree_mask(mask)
  assert packed.shape == (2, 70, 3) and packed.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(unpack_tree_mask(packed, 70)), np.asarray(mask))
  # bit b of word w is node 32 w + b; bit 31 is the sign bit of the int32 word
  one_hot = jnp.zeros((1, 64, 64), bool).at[0, 0, 31].set(True).at[0, 1, 32].set(True)
  words = np.asarray(pack_tree_mask(one_hot))
  assert words[0, 0, 0] == np.int32(-2**31) and words[0, 1].tolist() == [0, 1]


@pytest.mark.parametrize("platform,backend", [("cuda", "gpu"), ("tpu", "tpu")])
@pytest.mark.parametrize("n,d,dtype", [(1, 64, jnp.float32), (65, 128, jnp.bfloat16)])
def test_lowers_for_the_real_backend(platform, backend, n, d, dtype):
  """Ahead-of-time lowering to Triton / Mosaic IR, on this CPU machine (no device needed)."""
  q = jax.ShapeDtypeStruct((1, n, 8, d), dtype)
  kv = jax.ShapeDtypeStruct((1, 4096, 2, d), dtype)
  length = jax.ShapeDtypeStruct((1,), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, n, n), jnp.bool_)
  fn = jax.jit(lambda *a: tree_attention(*a, sm_scale=d**-0.5, backend=backend))
  text = fn.trace(q, kv, kv, length, mask).lower(lowering_platforms=(platform,)).as_text()
  assert "tree_attention" in text


def _equations(jaxpr, primitive: str):
  """The equations of `primitive` in a jaxpr and every jaxpr nested in its equations' params."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == primitive:
      yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner, primitive)


def _pallas_calls(jaxpr):
  return _equations(jaxpr, "pallas_call")


@pytest.mark.parametrize("platform,backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_cost_estimate_from_the_shapes(platform, backend):
  """Both paths tell XLA their cost: 2 matmuls and one exp per (row, slot), every byte once."""
  b, n, h, kv, s, d = 2, 5, 8, 2, 1024, 64
  q = jax.ShapeDtypeStruct((b, n, h, d), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((b, s, kv, d), jnp.bfloat16)
  length = jax.ShapeDtypeStruct((b,), jnp.int32)
  mask = jax.ShapeDtypeStruct((b, n, n), jnp.bool_)
  fn = jax.jit(lambda *a: tree_attention(*a, sm_scale=d**-0.5, backend=backend))
  (call,) = _pallas_calls(jax.make_jaxpr(fn)(q, cache, cache, length, mask).jaxpr)
  cost = call.params["cost_estimate"]
  rows = b * kv * 32  # M = N * G = 20 rows per KV head, padded to a 32-row block on both paths
  assert (cost.flops, cost.transcendentals) == (4 * rows * s * d, rows * s)
  assert cost.bytes_accessed > 2 * (b * n * h * d + 2 * b * s * kv * d)  # q, k, v (bf16) at least
  if backend == "tpu":  # Mosaic carries it into the custom call (Triton's lowering drops it)
    text = fn.trace(q, cache, cache, length, mask).lower(lowering_platforms=(platform,)).as_text()
    assert re.search(rf"flops(\\22)?:{cost.flops}\b", text)  # JSON in an escaped MLIR string


@pytest.mark.parametrize("backend,interpret,dtype,want", [
    ("gpu", False, jnp.float32, lax.DotAlgorithmPreset.TF32_TF32_F32_X3),  # tensor cores
    ("gpu", True, jnp.float32, lax.Precision.HIGHEST),  # the CPU has no TF32
    ("gpu", False, jnp.bfloat16, lax.Precision.HIGHEST),
    ("tpu", False, jnp.float32, lax.Precision.HIGHEST),
])
def test_kernel_dots_are_float32_accurate(backend, interpret, dtype, want):
  """Both dots of the online softmax get f32-accurate products for float32 inputs: IEEE on the
  CPU and Mosaic, three TF32 passes when compiled for the GPU (IEEE f32 there runs without
  tensor cores), and one pass for bf16, whose products are exact in f32."""
  q = jax.ShapeDtypeStruct((1, 9, 8, 64), dtype)
  cache = jax.ShapeDtypeStruct((1, 256, 2, 64), dtype)
  fn = jax.jit(lambda *a: tree_attention(*a, sm_scale=0.125, backend=backend,
                                         interpret=interpret))
  jaxpr = jax.make_jaxpr(fn)(q, cache, cache, jax.ShapeDtypeStruct((1,), jnp.int32),
                             jax.ShapeDtypeStruct((1, 9, 9), jnp.bool_)).jaxpr
  (call,) = _pallas_calls(jaxpr)
  dots = _equations(call.params["jaxpr"], "dot_general")
  precisions = [eqn.params["precision"] for eqn in dots]
  assert len(precisions) == (4 if backend == "tpu" else 2)  # Mosaic unrolls its K = 2 heads
  for precision in precisions:
    assert want in (precision if isinstance(precision, tuple) else (precision,))


@pytest.mark.parametrize("change,message", [
    (dict(q_heads=6), "multiple of KV heads"),
    (dict(nodes=9), "does not fit the cache"),
    (dict(mask_shape=(1, 4, 3)), "bool tree_mask must be"),
    (dict(packed_words=2), "packed tree_mask must be"),
    (dict(length_shape=(2,)), "length must be"),
    (dict(head_dim=24), "power-of-two head_dim"),
    (dict(cache_dtype=jnp.bfloat16), "share one floating dtype"),
    (dict(block_sizes=BlockSizes(block_kv=24)), "power-of-two block sizes"),
])
def test_rejects_bad_inputs(change, message):
  n, h, d = change.get("nodes", 4), change.get("q_heads", 4), change.get("head_dim", 16)
  q = jnp.zeros((1, n, h, d))
  kv = jnp.zeros((1, 8, 4, d), change.get("cache_dtype", jnp.float32))
  length = jnp.zeros(change.get("length_shape", (1,)), jnp.int32)
  mask = jnp.ones(change.get("mask_shape", (1, n, n)), bool)
  if "packed_words" in change:
    mask = jnp.zeros((1, n, change["packed_words"]), jnp.int32)
  with pytest.raises(ValueError, match=message):
    tree_attention(q, kv, kv, length, mask, sm_scale=1.0, interpret=True, backend="gpu",
                   block_sizes=change.get("block_sizes"))


@pytest.mark.parametrize("kwargs", [dict(block_kv=0), dict(block_kv=12), dict(block_q=4),
                                    dict(num_splits=0)])
def test_block_sizes_are_validated(kwargs):
  with pytest.raises(ValueError, match="BlockSizes"):
    BlockSizes(**kwargs)


def test_cpu_needs_interpret():
  if jax.default_backend() != "cpu":
    pytest.skip("only meaningful on a CPU backend")
  x = jnp.zeros((1, 1, 1, 16))
  with pytest.raises(ValueError, match="interpret=True"):
    tree_attention(x, x, x, jnp.zeros((1,), jnp.int32), jnp.ones((1, 1, 1), bool), sm_scale=1.0)
