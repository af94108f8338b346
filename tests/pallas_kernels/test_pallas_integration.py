"""`attention_impl="pallas"` in the model: the adapter against the XLA path, and greedy generation.

On CPU the kernel runs in interpret mode. Tolerance: float32 1e-5 of the output scale for one
attention call (the kernel file's policy). Generation must be token-identical, on the embedded
target in its shipped dtype: on a GPU or TPU for every drafter registered in `specjax.drafters`
(looked up at test time, so new ones are covered) and autoregressive decoding; on CPU, where
interpreting the kernel makes each program slow, for one drafter per shape of the verified
block the kernel sees (`CPU_DRAFTERS`).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from pallas_kernels.bench import random_tree_mask
from specjax import assets, drafters
from specjax.models import attention, decoder
from specjax.models import pallas_attention as adapter
from specjax.models.pallas_attention import MAX_TREE_TOKENS, pallas_attention

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_kernel_package_imports_no_specjax():
  """`pallas_kernels` is a leaf: the kernels, references and bench stand without the model."""
  code = ("import sys, pallas_kernels, pallas_kernels.bench\n"
          "loaded = [m for m in sys.modules if m.split('.')[0] == 'specjax']\n"
          "assert not loaded, loaded\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=_ROOT)


def _inputs(seed, b, t, h, kv, d, s):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in [(b, t, h, d), (b, s, kv, d), (b, s, kv, d)])
  return q, k, v


@pytest.mark.parametrize("t,lengths,kind", [
    (1, [5, 40], "decode"),
    (9, [0, 31], "tree"),  # verification: [root | 8 nodes], the root row sees only itself
    (16, [0, 0], "prefill"),  # a short prompt bucket: causal mask, padded rows
])
def test_adapter_matches_xla_attention(t, lengths, kind):
  q, k, v = _inputs(0, 2, t, 4, 2, 32, 48)
  length = jnp.asarray(lengths, jnp.int32)
  if kind == "prefill":
    new_mask = decoder.causal_mask(jnp.array([11, 16]), t)
  else:
    new_mask = jnp.asarray(random_tree_mask(np.random.default_rng(1), 2, t))
    new_mask = new_mask.at[:, 0, 1:].set(False)
  # XLA's default f32 matmul on a GPU is one TF32 pass (~1e-3 off); the kernel's products are
  # f32-accurate on every backend, so it is compared with f32 products.
  with jax.default_matmul_precision("highest"):
    want = attention.xla_attention(q, k, v, length, new_mask, sm_scale=0.2)
  got = pallas_attention(q, k, v, length, new_mask, sm_scale=0.2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                             atol=1e-5 * float(jnp.abs(want).max()))


def test_adapter_falls_back_to_xla():
  q, k, v = _inputs(0, 1, MAX_TREE_TOKENS + 1, 4, 2, 32, MAX_TREE_TOKENS + 8)
  mask = decoder.causal_mask(jnp.array([MAX_TREE_TOKENS + 1]), MAX_TREE_TOKENS + 1)
  for length in (jnp.zeros((1,), jnp.int32), None):  # a long prefill; no cache at all
    kv = k if length is not None else k[:, :MAX_TREE_TOKENS + 1]
    assert not adapter.kernel_applies(q, kv, length)
    want = attention.xla_attention(q, kv, kv, length, mask, sm_scale=0.2)
    np.testing.assert_array_equal(pallas_attention(q, kv, kv, length, mask, sm_scale=0.2), want)


def test_registered_and_used_by_the_model(monkeypatch):
  assert attention.get_attention_impl("pallas") is pallas_attention
  calls = []
  kernel = adapter.tree_attention
  monkeypatch.setattr(adapter, "tree_attention",
                      lambda q, *a, **kw: calls.append(q.shape[1]) or kernel(q, *a, **kw))
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=32,
                            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=16, qk_norm=True, attention_impl="pallas")
  params = decoder.init_params(cfg)
  cache = decoder.init_cache(cfg, 1, MAX_TREE_TOKENS + 8)

  def traced_calls(t):  # the kernel calls made when tracing one forward over T new tokens
    calls.clear()
    tokens = jnp.zeros((1, t), jnp.int32)
    mask = jnp.tril(jnp.ones((1, t, t), bool))
    jax.make_jaxpr(lambda p, c: decoder.forward(cfg, p, tokens, tokens, mask, c))(params, cache)
    return list(calls)

  assert traced_calls(1) == [1] * cfg.num_layers  # a decode step
  assert traced_calls(13) == [13] * cfg.num_layers  # verifying a 12-node tree
  assert traced_calls(MAX_TREE_TOKENS + 1) == []  # prefill-sized: the XLA path


@pytest.fixture(scope="module")
def embedded_targets():
  return {impl: specjax.load_target(assets.TARGET_DIR, attention_impl=impl)
          for impl in ("xla", "pallas")}


PROMPTS = ["def fibonacci(n):\n    ", "import os\n\nclass Path"]


# One verified block per shape: a decode step, a chain, a static tree, EAGLE-2's dynamic tree,
# a DFlash block (its tree of marginals).
CPU_DRAFTERS = (None, "prompt_lookup", "medusa", "eagle3", "dflash")


@pytest.mark.parametrize("name", [None] + drafters.names())
def test_greedy_generation_is_identical(embedded_targets, name):
  if jax.default_backend() == "cpu" and name not in CPU_DRAFTERS:
    pytest.skip("on CPU one drafter per verified block's shape (CPU_DRAFTERS); every drafter "
                "on a GPU or TPU")
  outputs = {}
  for impl, target in embedded_targets.items():
    if name is not None and name not in drafters.available(target):
      pytest.skip(f"drafter {name!r} is not available for the embedded target")
    drafter = None if name is None else drafters.build(name, target)
    outputs[impl] = specjax.generate(target, PROMPTS, max_new_tokens=20, drafter=drafter).tokens
  assert outputs["pallas"] == outputs["xla"]
  assert all(len(row) == 20 for row in outputs["xla"])


def test_benchmark_entry_point_runs(capsys):
  from experiments import bench_kernels
  rows = bench_kernels.main(["--sizes", "40,5000", "--nodes", "1,9", "--heads", "4", "--kv-heads",
                             "2", "--head-dim", "32", "--dtype", "float32", "--iters", "1",
                             "--cpu-max-size", "64"])
  checked = [r for r in rows if r.impl == "pallas" and r.seconds]
  points = 2 if jax.default_backend() == "cpu" else 4  # CPU: S = 5000 > --cpu-max-size skipped
  assert len(checked) == points and all(r.note == "ok" for r in checked)
  assert [r.impl for r in rows if r.seconds] == ["pallas", "reference", "xla"] * points
  assert "max err" in capsys.readouterr().out


def test_bench_times_the_implementations_passed_in():
  from pallas_kernels import bench, tree_attention_reference
  shape = dict(heads=4, kv_heads=2, head_dim=32, dtype="float32", iters=1)
  rows = bench.run([40], [3], **shape, impls={"again": tree_attention_reference})
  assert [r.impl for r in rows] == ["pallas", "reference", "again"]
  assert rows[0].note == "ok" and all(r.seconds for r in rows)
  with pytest.raises(ValueError, match="always run"):
    bench.run([40], [3], **shape, impls={"reference": tree_attention_reference})
