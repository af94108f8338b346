"""The attention registry is what `ModelConfig.attention_impl` accepts and what the decoder calls.

Every test that registers a name works on a copy of the registry, so no name leaks into another
test module.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import attention, decoder
from specjax.models.config import ModelConfig

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_TINY = dict(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


@pytest.fixture
def registry(monkeypatch):
  """A private copy of the registry for one test."""
  monkeypatch.setattr(attention, "_IMPLS", dict(attention._IMPLS))
  monkeypatch.setattr(attention, "_LAZY", dict(attention._LAZY))


def test_builtin_names_are_registered():
  assert {"xla", "pallas"} <= set(attention.attention_impls())
  assert attention.get_attention_impl("xla") is attention.xla_attention


def test_unknown_name_is_rejected_with_the_registered_ones():
  with pytest.raises(ValueError, match="unknown attention_impl 'nope'") as err:
    ModelConfig(attention_impl="nope")
  for name in attention.attention_impls():
    assert repr(name) in str(err.value)
  with pytest.raises(ValueError, match="registered"):
    attention.get_attention_impl("nope")


def test_registered_impl_is_accepted_and_used_by_the_decoder(registry):
  calls = []

  def mine(q, k, v, length, new_mask, *, sm_scale):
    calls.append(q.shape)
    return attention.xla_attention(q, k, v, length, new_mask, sm_scale=sm_scale)

  with pytest.raises(ValueError, match="unknown attention_impl"):
    ModelConfig(attention_impl="mine")
  attention.register_attention_impl("mine", mine)
  assert "mine" in attention.attention_impls()
  cfg = ModelConfig(**_TINY, attention_impl="mine")
  params = decoder.init_params(cfg)
  tokens = jnp.arange(6, dtype=jnp.int32)[None]
  mask = decoder.causal_mask(jnp.array([6]), 6)
  cache = decoder.init_cache(cfg, 1, 16)
  got = decoder.forward(cfg, params, tokens, tokens, mask, cache).logits
  assert calls == [(1, 6, 4, 16)] * cfg.num_layers
  want = decoder.forward(cfg.replace(attention_impl="xla"), params, tokens, tokens, mask,
                         cache).logits
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_registering_replaces_a_lazy_entry(registry):
  attention.register_attention_impl("pallas", attention.xla_attention)
  assert attention.get_attention_impl("pallas") is attention.xla_attention


def test_importing_specjax_does_not_import_pallas():
  """`"pallas"` is a lazy entry: a config naming it is valid without loading the kernel."""
  code = ("import sys, specjax\n"
          "specjax.ModelConfig(attention_impl='pallas')\n"
          "loaded = [m for m in sys.modules if m.split('.')[0] == 'pallas_kernels'\n"
          "          or m.startswith(('jax.experimental.pallas', 'specjax.models.pallas'))]\n"
          "assert not loaded, loaded\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=_ROOT)
