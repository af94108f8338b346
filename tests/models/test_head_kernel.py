"""The LM head weight a CPU program lays out once for its verifications (`decoder.head_kernel`):
the same logits as the model's own head, and only where it pays (`decoder.copies_head`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import decoder
from tests.helpers import tiny_targets as tt


@pytest.fixture(scope="module")
def tied():
  cfg = dataclasses.replace(tt.config(64), tie_word_embeddings=True)
  return tt.scaled_target(cfg, seed=2)


def test_the_kernel_is_the_tied_table_laid_out_e_by_v(tied):
  kernel = decoder.head_kernel(tied.config, tied.params)
  table = np.asarray(tied.params["embed_tokens"]["embedding"][...])
  assert kernel.shape == (tied.config.hidden_size, tied.config.vocab_size)
  np.testing.assert_array_equal(kernel, table.T)


def test_only_a_tied_head_verifying_blocks_on_a_cpu_is_copied(tied):
  cfg = tied.config
  assert decoder.copies_head(cfg, "cpu", 8)
  assert not decoder.copies_head(cfg, "cpu", 1)  # a one-token step reads the table as fast
  assert not decoder.copies_head(cfg, "gpu", 8) and not decoder.copies_head(cfg, "tpu", 8)
  assert not decoder.copies_head(tt.config(64), "cpu", 8)  # untied: its kernel is [E, V]


@pytest.mark.parametrize("rows", [1, 8])
def test_forward_with_the_kernel_gives_the_models_logits(tied, rows):
  cfg, params = tied.config, tied.params
  tokens = jnp.asarray([[5, 9, 2, 40, 7, 7, 1, 3][:rows]], jnp.int32)
  positions = jnp.arange(rows, dtype=jnp.int32)[None]
  mask = decoder.causal_mask(jnp.asarray([rows]), rows)
  own = decoder.forward(cfg, params, tokens, positions, mask)
  copy = decoder.forward(cfg, params, tokens, positions, mask,
                         head_kernel=decoder.head_kernel(cfg, params))
  np.testing.assert_allclose(copy.logits, own.logits, rtol=1e-5, atol=1e-5)
  assert np.array_equal(np.argmax(copy.logits, -1), np.argmax(own.logits, -1))
