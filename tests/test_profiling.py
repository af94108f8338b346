"""`specjax.profiling.verify_parts`: the verify-step breakdown behind `bench_roofline`."""

import math

import pytest

import specjax
from specjax.decoding import bucket_length, cache_length
from specjax.profiling import PARTS, verify_parts


@pytest.fixture(scope="module")
def target():
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=256, hidden_size=32,
                            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, qk_norm=True, tie_word_embeddings=True,
                            max_position_embeddings=256)
  return specjax.Target.random(cfg)


def test_rows_per_block_size(target):
  rows = verify_parts(target, (1, 4), prompt_len=20, max_new=16, repeats=2, trials=1)
  assert [r["t"] for r in rows] == [1, 4]
  limit = target.config.context_length
  for r in rows:
    assert set(PARTS) <= r.keys()
    assert all(math.isfinite(r[k]) for k in PARTS)
    # The cache `generate` allocates for this prompt, max_new and a chain of T - 1 nodes.
    assert r["cache_slots"] == cache_length(bucket_length(20, limit), 16, r["t"] - 1, limit)
  assert rows[0]["ratio"] == 1.0
  assert rows[1]["ratio"] == rows[1]["phase"] / rows[0]["phase"]


def test_bad_sizes(target):
  with pytest.raises(ValueError, match="block size"):
    verify_parts(target, (0,), prompt_len=8, max_new=8, repeats=1, trials=1)
