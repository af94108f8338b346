"""specjax's decoder against transformers on tiny random checkpoints (tests/helpers/hf_models.py).

Tolerance policy: float32 whole-model outputs agree within 1e-4 (max abs diff of
logits, which here have scale ~10). Hidden states of the un-normalised residual stream reach
|x| ~ 60, where one float32 ulp is already 4e-6; the next layer reads them only through RMSNorm,
so they are compared with the same 1e-4 relative to each position's RMS. bfloat16 has its own,
stated bound in its test. Every reference is computed by transformers on the unpadded sequence.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import specjax
from specjax.interop import hf as hf_interop
from specjax.models import decoder
from specjax.models.config import ModelConfig, RopeScaling
from tests.helpers import hf_models

VARIANTS = list(hf_models.VARIANTS)
VOCAB = 211  # hf_models._BASE
ATOL = 1e-4

_full_forward = jax.jit(decoder.full_forward, static_argnums=0, static_argnames="hidden_layers")
_forward = jax.jit(decoder.forward, static_argnums=0)


def _hf_logits(model, tokens, hidden=False):
  """transformers on one unpadded sequence: float32 logits [T, V] (and hidden states)."""
  with torch.no_grad():
    out = model(torch.tensor(np.asarray(tokens, np.int64)[None]), output_hidden_states=hidden)
  logits = out.logits[0].float().numpy()
  return (logits, [h[0].float().numpy() for h in out.hidden_states]) if hidden else logits


def _pad(rows, width, rng):
  """Right-pads token rows to `width` with random junk (padding must not matter): int32 [B, W]."""
  tokens = rng.integers(0, VOCAB, (len(rows), width))
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return jnp.asarray(tokens, jnp.int32), jnp.asarray([len(r) for r in rows], jnp.int32)


def _max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _ancestor_mask(parents):
  """bool[N, N]: node i sees node j iff j is i itself or one of its ancestors."""
  n = len(parents)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parents[j]
  return mask


def _path(parents, i):
  """Node indices from the root to node i."""
  out = []
  while i >= 0:
    out.append(i)
    i = parents[i]
  return out[::-1]


# -- 1. full forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_full_forward_matches_transformers(hf_checkpoint, variant):
  """Right-padded ragged batch [40, 23, 7]: logits and hidden states (0, 1, L) equal HF per row.

  Why: every other path (prefill, decode, verification, training) is the same `forward`; a wrong
  tensor mapping, RoPE variant, GQA grouping, bias or q/k norm shows up here first. Padding is
  random junk, so a mask that lets real positions see padding fails too.
  """
  ckpt = hf_checkpoint(variant)
  cfg, params = ckpt.target.config, ckpt.target.params
  layers = (0, 1, cfg.num_layers)
  rng = np.random.default_rng(0)
  rows = [rng.integers(0, VOCAB, n) for n in (40, 23, 7)]
  tokens, lengths = _pad(rows, 40, rng)
  out = _full_forward(cfg, params, tokens, lengths, hidden_layers=layers)
  assert out.logits.shape == (3, 40, VOCAB) and out.hidden.shape == (3, 3, 40, cfg.hidden_size)
  for b, row in enumerate(rows):
    n = len(row)
    ref_logits, ref_hidden = _hf_logits(ckpt.hf_model, row, hidden=True)
    assert len(ref_hidden) == cfg.num_layers + 1
    assert _max_abs(out.logits[b, :n], ref_logits) <= ATOL, f"row {b} logits"
    for i, layer in enumerate(layers):
      ref = ref_hidden[layer]
      got = np.asarray(out.hidden[i, b, :n])
      rms = np.sqrt(np.mean(ref * ref, axis=-1))  # [T]
      rel = np.max(np.abs(got - ref).max(axis=-1) / rms)
      assert rel <= ATOL, f"row {b} hidden state {layer}: error / rms = {rel:.2e}"


# -- 2. prefill + cached decoding --------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_cached_decode_matches_full_forward(hf_checkpoint, variant):
  """Prefill of ragged prefixes [12, 5, 16] then 8 single-token cached steps equal HF's logits.

  Why: this is exactly generate's data flow (`forward` with a `KVCache`, `write` then `advance`).
  The prefill writes junk KV past each row's length; the decode steps must overwrite, never
  attend to, it, and each row must use its own position.
  """
  ckpt = hf_checkpoint(variant)
  cfg, params = ckpt.target.config, ckpt.target.params
  rng = np.random.default_rng(1)
  p, steps = 16, 8
  prefix_lens = np.array([12, 5, 16])
  prefixes = [rng.integers(0, VOCAB, n) for n in prefix_lens]
  cont = rng.integers(0, VOCAB, (3, steps))
  tokens, lengths = _pad(prefixes, p, rng)
  cache = decoder.init_cache(cfg, 3, p + steps)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (3, p))
  out = _forward(cfg, params, tokens, positions, decoder.causal_mask(lengths, p), cache)
  prefill_logits = np.asarray(out.logits)
  cache = out.cache.advance(lengths)
  step_logits = []
  for s in range(steps):
    out = _forward(cfg, params, jnp.asarray(cont[:, s:s + 1], jnp.int32), cache.length[:, None],
                   jnp.ones((3, 1, 1), bool), cache)
    step_logits.append(np.asarray(out.logits[:, 0]))
    cache = out.cache.advance(jnp.ones((3,), jnp.int32))
  np.testing.assert_array_equal(cache.length, prefix_lens + steps)
  for b in range(3):
    n = prefix_lens[b]
    ref = _hf_logits(ckpt.hf_model, np.concatenate([prefixes[b], cont[b]]))
    assert _max_abs(prefill_logits[b, :n], ref[:n]) <= ATOL, f"row {b} prefill"
    for s in range(steps):
      assert _max_abs(step_logits[s][b], ref[n + s]) <= ATOL, f"row {b} step {s}"


# -- 3. custom masks: packing, trees, commit ---------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_sequences_with_block_mask_equal_separate_forwards(hf_checkpoint, variant):
  """Two independent sequences packed in one row (block-causal mask, positions restarting at 0)
  give each sequence's own causal logits. Why: `new_mask` and `positions` are the only things
  that define what a query sees; training packs sequences this way."""
  ckpt = hf_checkpoint(variant)
  cfg, params = ckpt.target.config, ckpt.target.params
  rng = np.random.default_rng(2)
  n1, n2 = 9, 7
  s1, s2 = rng.integers(0, VOCAB, n1), rng.integers(0, VOCAB, n2)
  seg = np.array([0] * n1 + [1] * n2)
  mask = (seg[:, None] == seg[None, :]) & np.tri(n1 + n2, dtype=bool)
  positions = np.concatenate([np.arange(n1), np.arange(n2)])
  out = _forward(cfg, params, jnp.asarray(np.concatenate([s1, s2])[None], jnp.int32),
                 jnp.asarray(positions[None], jnp.int32), jnp.asarray(mask[None]), None)
  assert _max_abs(out.logits[0, :n1], _hf_logits(ckpt.hf_model, s1)) <= ATOL
  assert _max_abs(out.logits[0, n1:], _hf_logits(ckpt.hf_model, s2)) <= ATOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_tree_verification_and_commit_equal_causal_forwards(hf_checkpoint, variant):
  """A draft tree (root r; branches r-a1-a2 and r-b1-b2) verified in one cached call with the
  ancestor-or-self mask and positions length + depth gives, at every node, the logits of the plain
  causal forward of prefix + root-to-node path. Then `KVCache.commit` keeps a gathered path (row 0:
  r, b1, b2, i.e. slots [0, 3, 4]; row 1: r, a1) and one more decoded token equals the causal
  forward of prefix + kept path + token.

  Why: this is speculative verification and rollback; the second branch's KV sits in
  non-contiguous slots that commit must move in front of the next token.
  """
  ckpt = hf_checkpoint(variant)
  cfg, params = ckpt.target.config, ckpt.target.params
  rng = np.random.default_rng(3)
  parents = [-1, 0, 1, 0, 3]
  depth = np.array([len(_path(parents, i)) - 1 for i in range(5)])
  mask = _ancestor_mask(parents)
  p, prefix_lens = 16, np.array([10, 6])
  prefixes = [rng.integers(0, VOCAB, n) for n in prefix_lens]
  tree = rng.integers(0, VOCAB, (2, 5))
  tokens, lengths = _pad(prefixes, p, rng)
  cache = decoder.init_cache(cfg, 2, 32)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (2, p))
  cache = _forward(cfg, params, tokens, positions, decoder.causal_mask(lengths, p),
                   cache).cache.advance(lengths)
  out = _forward(cfg, params, jnp.asarray(tree, jnp.int32),
                 jnp.asarray(prefix_lens[:, None] + depth[None], jnp.int32),
                 jnp.asarray(np.broadcast_to(mask, (2, 5, 5))), cache)
  np.testing.assert_array_equal(out.cache.length, prefix_lens)  # forward does not advance
  for b in range(2):
    for i in range(5):
      seq = np.concatenate([prefixes[b], tree[b, _path(parents, i)]])
      assert _max_abs(out.logits[b, i], _hf_logits(ckpt.hf_model, seq)[-1]) <= ATOL, (b, i)

  keep = np.array([[0, 3, 4], [0, 1, 0]])  # row 1's third entry is padding (n_keep = 2)
  n_keep = np.array([3, 2])
  cache = out.cache.commit(jnp.asarray(keep, jnp.int32), jnp.asarray(n_keep, jnp.int32))
  np.testing.assert_array_equal(cache.length, prefix_lens + n_keep)
  nxt = rng.integers(0, VOCAB, (2, 1))
  out = _forward(cfg, params, jnp.asarray(nxt, jnp.int32), cache.length[:, None],
                 jnp.ones((2, 1, 1), bool), cache)
  for b in range(2):
    seq = np.concatenate([prefixes[b], tree[b, keep[b, :n_keep[b]]], nxt[b]])
    assert _max_abs(out.logits[b, 0], _hf_logits(ckpt.hf_model, seq)[-1]) <= ATOL, b


# -- 4. bfloat16 -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_logits_close_to_float32(hf_checkpoint, variant):
  """`load_target(dtype="bfloat16", compute_dtype="bfloat16")` (bf16 weights and activations,
  the opt-in fast path) runs and stays as close to float32 as transformers' own bf16.

  Bounds (reasoned, not fitted): bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); these
  random models carry a residual stream of |x| ~ 60 into logits of RMS ~2.5, so the rounding of
  the stream alone is ~0.1 in the logits. We require
    * RMS(bf16 - f32) <= 10% of RMS(f32 logits);
    * RMS(bf16 - f32) <= 1.5 x the same error of transformers run in bf16 on the same weights
      (specjax must not add its own loss of precision, e.g. a softmax or norm in bf16);
    * argmax agrees on >= 90% of positions, and at every position whose f32 top-2 margin exceeds
      7 x the RMS error (a flip there would be a > 5-sigma rounding event).
  """
  ckpt = hf_checkpoint(variant)
  t32 = ckpt.target
  t16 = specjax.load_target(ckpt.path, dtype="bfloat16", compute_dtype="bfloat16")
  assert t16.config.dtype == t16.config.compute_dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(t16.params))
  tokens = np.random.default_rng(4).integers(0, VOCAB, (3, 40))
  f32 = np.asarray(_full_forward(t32.config, t32.params, jnp.asarray(tokens, jnp.int32)).logits)
  bf16 = _full_forward(t16.config, t16.params, jnp.asarray(tokens, jnp.int32)).logits
  assert bf16.dtype == jnp.bfloat16
  bf16 = np.asarray(bf16, np.float32)
  assert np.all(np.isfinite(bf16))
  hf16 = hf_models.build_hf_model(variant).to(torch.bfloat16)
  with torch.no_grad():
    hf_bf16 = hf16(torch.tensor(tokens)).logits.float().numpy()

  def rms(x):
    return float(np.sqrt(np.mean(np.square(x))))

  err, hf_err, scale = rms(bf16 - f32), rms(hf_bf16 - f32), rms(f32)
  assert err <= 0.1 * scale, (err, scale)
  assert err <= 1.5 * hf_err, (err, hf_err)
  agree = f32.argmax(-1) == bf16.argmax(-1)
  assert agree.mean() >= 0.9, agree.mean()
  top2 = np.sort(f32, axis=-1)[..., -2:]
  clear = top2[..., 1] - top2[..., 0] > 7 * err
  assert np.all(agree[clear]), "argmax flipped where the f32 top-2 margin is large"


@pytest.mark.parametrize("variant", ["llama_gqa_tied", "qwen3_qknorm"])
def test_bfloat16_weights_compute_in_float32_by_default(hf_checkpoint, variant):
  """The numerics policy: a bf16-stored target (the default `compute_dtype`) keeps its weights
  in bf16 and computes in float32: float32 logits and KV cache, within the float32 whole-model
  tolerance (1e-4) of the float32 model of those same rounded weights (not bit-equal: XLA fuses
  the upcast into the matmuls, which may sum in another order), and far closer to it than
  computing in bf16 is."""
  ckpt = hf_checkpoint(variant)
  t16 = specjax.load_target(ckpt.path, dtype="bfloat16")
  assert t16.config.compute_dtype == "float32"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(t16.params))
  rounded = ckpt.target.replace(params=jax.tree.map(
      lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), ckpt.target.params))
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, (2, 24)), jnp.int32)
  layers = tuple(range(t16.config.num_layers + 1))
  a = _full_forward(t16.config, t16.params, tokens, hidden_layers=layers)
  b = _full_forward(rounded.config, rounded.params, tokens, hidden_layers=layers)
  assert a.logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-4, rtol=0)
  fast = specjax.load_target(ckpt.path, dtype="bfloat16", compute_dtype="bfloat16")
  c = _full_forward(fast.config, fast.params, tokens).logits.astype(jnp.float32)
  err = np.abs(np.asarray(a.logits) - np.asarray(b.logits)).max()
  assert err < 0.01 * np.abs(np.asarray(c) - np.asarray(b.logits)).max()
  cache = decoder.init_cache(t16.config, 1, 8)
  assert all(x.dtype == jnp.float32 for x in cache.k + cache.v)


# -- 5. round trips ----------------------------------------------------------------------------


def _assert_params_identical(a, b):
  fa = dict(jax.tree_util.tree_leaves_with_path(a))
  fb = dict(jax.tree_util.tree_leaves_with_path(b))
  assert fa.keys() == fb.keys()
  assert len(fa) == len(hf_interop.to_hf_tensors(a))  # one leaf per checkpoint tensor
  for k in fa:
    x, y = np.asarray(fa[k]), np.asarray(fb[k])
    assert x.dtype == y.dtype and x.shape == y.shape, k
    assert np.array_equal(x, y), f"{jax.tree_util.keystr(k)} differs"


def _assert_hf_matches(ckpt, folder):
  """transformers loads `folder` with the original weights, bit for bit, and specjax's logits."""
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  assert type(model) is type(ckpt.hf_model)
  want = ckpt.hf_model.state_dict()
  got = model.state_dict()
  assert got.keys() == want.keys()
  for name in want:
    assert torch.equal(got[name], want[name]), name
  tokens = np.random.default_rng(5).integers(0, VOCAB, (2, 30))
  ours = _full_forward(ckpt.target.config, ckpt.target.params, jnp.asarray(tokens, jnp.int32))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  assert _max_abs(ours.logits, theirs) <= ATOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_hf_round_trips(hf_checkpoint, variant, tmp_path):
  """`save_hf` writes a folder that transformers loads (same weights, logits within 1e-4) and that
  `load_target` reads back to bitwise identical params. Why: specjax checkpoints (e.g. fine-tuned
  targets, trained drafters' bases) must be usable by the rest of the ecosystem, losslessly."""
  ckpt = hf_checkpoint(variant)
  specjax.save_hf(ckpt.target, tmp_path)
  assert (tmp_path / "model.safetensors").exists()
  assert not (tmp_path / "model.safetensors.index.json").exists()
  _assert_hf_matches(ckpt, tmp_path)
  back = specjax.load_target(tmp_path)
  assert back.config == ckpt.target.config
  _assert_params_identical(back.params, ckpt.target.params)


@pytest.mark.parametrize("variant", ["llama_mha", "qwen3_qknorm"])
def test_sharded_save_round_trips(hf_checkpoint, variant, tmp_path):
  """`max_shard_bytes` small: shards plus `model.safetensors.index.json` (covering every tensor,
  replacing a stale single file in the same folder) that both loaders read back identically."""
  ckpt = hf_checkpoint(variant)
  specjax.save_hf(ckpt.target, tmp_path)  # a single file first: the sharded save must remove it
  specjax.save_hf(ckpt.target, tmp_path, max_shard_bytes=40_000)
  assert not (tmp_path / "model.safetensors").exists()
  with open(tmp_path / "model.safetensors.index.json") as f:
    weight_map = json.load(f)["weight_map"]
  shards = sorted(set(weight_map.values()))
  assert len(shards) > 1
  assert sorted(os.listdir(tmp_path)) == sorted(
      shards + ["config.json", "generation_config.json", "model.safetensors.index.json"])
  assert set(weight_map) == set(hf_interop.to_hf_tensors(ckpt.target.params))
  back = specjax.load_target(tmp_path)
  _assert_params_identical(back.params, ckpt.target.params)
  _assert_hf_matches(ckpt, tmp_path)


# -- 6. config ---------------------------------------------------------------------------------

_DEFAULT_ROPE = (10000.0, RopeScaling())
# variant -> (architecture, layers, kv heads, head_dim, tied, qkv_bias, o_bias, qk_norm, rope)
_EXPECTED = {
    "llama_mha": ("llama", 2, 4, 16, False, False, False, False, _DEFAULT_ROPE),
    "llama_gqa_tied": ("llama", 2, 2, 16, True, False, False, False, _DEFAULT_ROPE),
    "llama_mqa": ("llama", 2, 1, 16, False, False, False, False, _DEFAULT_ROPE),
    "llama3_rope": ("llama", 3, 2, 16, False, False, False, False,
                    (500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))),
    "qwen2_bias": ("qwen2", 2, 2, 16, False, True, False, False, _DEFAULT_ROPE),
    "qwen3_qknorm": ("qwen3", 2, 2, 24, True, False, False, True, _DEFAULT_ROPE),
    "mistral_window": ("mistral", 2, 2, 16, False, False, False, False, _DEFAULT_ROPE),
    "phi3_fused": ("phi3", 2, 2, 16, False, False, False, False, _DEFAULT_ROPE),
    "gemma2_softcap": ("gemma2", 2, 2, 16, True, False, False, False, _DEFAULT_ROPE),
    # The full layers' RoPE; the sliding layers' base is `rope_local_theta` (checked below).
    "gemma3_text_mixed": ("gemma3_text", 3, 2, 16, True, False, False, True,
                          (1e4, RopeScaling("linear", 8.0))),
}
_WINDOWS = {"mistral_window": 48, "gemma2_softcap": 48, "gemma3_text_mixed": 48}  # else None


def _legacy_spelling(d):
  """transformers 4.x: `rope_theta` + `rope_scaling` (None for default RoPE), no rope_parameters;
  Gemma 3's per-layer-type parameters as the full layers' plus `rope_local_base_freq`."""
  d = dict(d)
  params = d.pop("rope_parameters")
  if "full_attention" in params:
    d["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    params = params["full_attention"]
  d["rope_theta"] = params["rope_theta"]
  scaling = {k: v for k, v in params.items() if k != "rope_theta"}
  d["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
  return d


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_from_hf_dict(variant):
  """`ModelConfig.from_hf_dict(hf_config.to_dict())` reads every field that changes the math, and
  the 4.x (`rope_theta` + `rope_scaling`, also with the older `type` key) and 5.x
  (`rope_parameters`) spellings give the same config, which `to_hf_dict` round-trips."""
  d = hf_models.build_hf_model(variant).config.to_dict()
  cfg = ModelConfig.from_hf_dict(d)
  arch, layers, kv, head_dim, tied, qkv_bias, o_bias, qk_norm, (theta, scaling) = _EXPECTED[variant]
  assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
      arch, layers, 4, kv, head_dim)
  assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (VOCAB, 64, 96)
  assert (cfg.tie_word_embeddings, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm) == (
      tied, qkv_bias, o_bias, False, qk_norm)
  assert cfg.rope_theta == theta and cfg.rope_scaling == scaling
  assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e-6, 512)
  assert cfg.eos_token_id == () and cfg.bos_token_id is None and cfg.dtype == "float32"
  assert cfg.sliding_window == _WINDOWS.get(variant)

  v5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
  v4 = _legacy_spelling(d)
  assert ModelConfig.from_hf_dict(v5) == cfg
  assert ModelConfig.from_hf_dict(v4) == cfg
  if v4["rope_scaling"] is not None:
    older = dict(v4, rope_scaling={("type" if k == "rope_type" else k): v
                                   for k, v in v4["rope_scaling"].items()})
    assert ModelConfig.from_hf_dict(older) == cfg
  assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
  assert ModelConfig.from_hf_dict(_legacy_spelling(cfg.to_hf_dict())) == cfg
