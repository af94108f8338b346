"""Published DFlash drafters (the z-lab / SpecForge layout) read into the `dflash` family.

  1. Forward equivalence: a random-weight checkpoint in the published layout (float32, and one
     stored in bfloat16) for a tiny HF Qwen3 target; the block logits specjax computes with the
     loaded drafter (`dflash.training_logits`, blocks anchored at several positions, depths
     1 .. B - 1) equal an independent torch forward of the published block written here from
     the format's description (context = hidden_norm(fc(taps of the outputs of layers id)), its
     keys k_norm'd and RoPE'd at their own positions and joined to the block's, non-causal
     attention, final norm, the target's head), within 1e-4 in float32.
  2. Greedy output of `specjax.generate` with the loaded drafter (a tree) equals autoregressive.
  3. Writing back: `export_drafter` then `load_drafter` gives identical params, taps and mask
     (a mask_token_id drafter; an own `mask_embedding` one; a d2t subset, bfloat16 export);
     `formats.detect` picks "dflash" for both the published and the written folder; a
     `mask_embedding` tensor next to a mask_token_id is read as the mask vector.
  4. Bad folders, each a ValueError naming the problem: missing / unexpected tensors, wrong
     shapes, hidden size or vocabulary of another target, mask_token_id outside the vocabulary
     (or no mask at all), taps out of range, no block_size, sliding-window layers; without
     target_layer_ids the reference's guess is used, with a warning.
"""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.torch import save_file

import specjax
from specjax.drafters import dflash, dflash_format, formats, io, learned
from specjax.models import decoder
from tests.helpers import torch_ref

L = 4  # target layers
H = 64  # the qwen3_qknorm variant's width
V = 211
MASK_ID = 210
CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "block_size": 4,
    "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 1, 3]},
    "num_target_layers": L,
    "num_hidden_layers": 2,
    "layer_types": ["full_attention"] * 2,
    "hidden_size": H,
    "intermediate_size": 80,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 5e5,
    "max_position_embeddings": 512,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "vocab_size": V,
    "torch_dtype": "bfloat16",
}
HISTORY = [3, 17, 42, 5, 99, 8, 150, 23, 7, 61, 2, 180]
STARTS = [0, 4, 10]  # blocks anchored at 1, 5 and 11 (the block's first token's position)


def published_tensors(config=CONFIG, seed=1) -> dict[str, torch.Tensor]:
  """Random tensors with the published names and shapes (torch layout, float32)."""
  g = torch.Generator().manual_seed(seed)
  e, f, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
  h, k = config["num_attention_heads"], config["num_key_value_heads"]
  n = len(config["dflash_config"]["target_layer_ids"])
  lin = lambda o, i: 0.3 * torch.randn(o, i, generator=g) / i ** 0.5  # noqa: E731
  norm = lambda m: 1.0 + 0.2 * torch.randn(m, generator=g)  # noqa: E731
  out = {"fc.weight": lin(e, n * e), "hidden_norm.weight": norm(e), "norm.weight": norm(e)}
  for i in range(config["num_hidden_layers"]):
    p = f"layers.{i}."
    out.update({
        p + "input_layernorm.weight": norm(e), p + "post_attention_layernorm.weight": norm(e),
        p + "self_attn.q_proj.weight": lin(h * d, e), p + "self_attn.k_proj.weight": lin(k * d, e),
        p + "self_attn.v_proj.weight": lin(k * d, e), p + "self_attn.o_proj.weight": lin(e, h * d),
        p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
        p + "mlp.gate_proj.weight": lin(f, e), p + "mlp.up_proj.weight": lin(f, e),
        p + "mlp.down_proj.weight": lin(e, f)})
  return out


def publish(path, tensors, config=CONFIG, dtype=torch.float32) -> str:
  os.makedirs(path, exist_ok=True)
  save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
            os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return os.fspath(path)


def torch_block_logits(model, tensors, config, history, anchor) -> np.ndarray:
  """[B - 1, V] logits of depths 1 .. B - 1 of the block anchored at `anchor` (its first token
  history[anchor] at position anchor, masks after it), from the published description."""
  w = lambda name: torch_ref.weight({name: tensors[name].double().numpy()}, name)  # noqa: E731
  c = config
  eps, theta, b = c["rms_norm_eps"], c["rope_theta"], c["block_size"]
  heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  states = torch_ref.hidden_states(model, history[:anchor])  # outputs of layer id: [id + 1]
  feats = torch.cat([states[i + 1] for i in c["dflash_config"]["target_layer_ids"]], -1)
  ctx = torch_ref.rms_norm(feats @ w("fc.weight").T, w("hidden_norm.weight"), eps)
  emb = model.model.embed_tokens.weight.double()
  x = torch.cat([emb[history[anchor]][None],
                 emb[c["dflash_config"]["mask_token_id"]][None].expand(b - 1, -1)])
  pos_blk = torch.arange(anchor, anchor + b)
  pos_kv = torch.arange(anchor + b)  # context 0 .. anchor - 1, then the block
  for i in range(c["num_hidden_layers"]):
    p = f"layers.{i}."
    xn = torch_ref.rms_norm(x, w(p + "input_layernorm.weight"), eps)
    q = (xn @ w(p + "self_attn.q_proj.weight").T).view(b, heads, d)
    q = torch_ref.rope(torch_ref.rms_norm(q, w(p + "self_attn.q_norm.weight"), eps), pos_blk,
                       theta)
    src = torch.cat([ctx, xn])  # the context is not input_layernorm'd
    k = (src @ w(p + "self_attn.k_proj.weight").T).view(-1, kv, d)
    k = torch_ref.rope(torch_ref.rms_norm(k, w(p + "self_attn.k_norm.weight"), eps), pos_kv,
                       theta)
    v = (src @ w(p + "self_attn.v_proj.weight").T).view(-1, kv, d)
    attn = torch_ref.attention(q, k, v, torch.ones(b, anchor + b, dtype=torch.bool))
    x = x + attn @ w(p + "self_attn.o_proj.weight").T
    x = x + torch_ref.swiglu(torch_ref.rms_norm(x, w(p + "post_attention_layernorm.weight"), eps),
                             w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"),
                             w(p + "mlp.down_proj.weight"))
  out = torch_ref.rms_norm(x, w("norm.weight"), eps)
  with torch.no_grad():
    return (out @ model.lm_head.weight.double().T)[1:].numpy()


def specjax_block_logits(target, drafter, history, starts) -> np.ndarray:
  """[N, B - 1, Vd] the loaded drafter's block logits after each start (anchor start + 1)."""
  cfg, net_cfg = target.config, drafter.net

  @jax.jit
  def logits(target_params, params, head, tokens, starts):
    hidden = decoder.full_forward(cfg, target_params, tokens,
                                  hidden_layers=drafter.hidden_layers).hidden
    net = learned.merge(dflash.DFlashNet, net_cfg, params)
    emb = learned.target_embedding(cfg, target_params)
    return dflash.training_logits(net, net_cfg, learned.concat_features(hidden), tokens, emb,
                                  head, starts, net_cfg.block_size - 1)

  out = logits(target.params, drafter.params, drafter.head, jnp.asarray([history], jnp.int32),
               jnp.asarray([starts], jnp.int32))
  return np.asarray(out[:, 0]).transpose(1, 0, 2)


def flat(drafter) -> dict[str, np.ndarray]:
  return {".".join(str(k) for k in key): np.asarray(var[...])
          for key, var in nnx.to_flat_state(drafter.params)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """(torch target in float64, specjax Target in float32) of a tiny 4-layer HF Qwen3."""
  return torch_ref.hf_target(tmp_path_factory.mktemp("qwen3"), "qwen3_qknorm",
                             num_hidden_layers=L)


@pytest.fixture(scope="module")
def tensors():
  return published_tensors()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tensors):
  return publish(tmp_path_factory.mktemp("dflash"), tensors)


# ------------------------------------------------------------------------------------------------
# 1. The forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_logits_match_the_published_forward(hf, tensors, tmp_path, dtype):
  model, target = hf
  path = publish(tmp_path / "ckpt", tensors, dtype=dtype)
  assert formats.detect(path) == "dflash"
  drafter = io.load_drafter(path, target)
  assert drafter.hidden_layers == (1, 2, 4)  # ids are outputs of layers: index id + 1
  assert drafter.net.mask_token_id == MASK_ID and drafter.net.block_size == 4
  assert drafter.net.model.head_dim == 16 and drafter.net.model.num_layers == 2
  np.testing.assert_array_equal(np.asarray(drafter.d2t), np.arange(V))
  stored = {k: v.to(dtype).double() for k, v in tensors.items()}  # what the file holds
  got = specjax_block_logits(target, drafter, HISTORY, STARTS)
  assert got.shape == (len(STARTS), 3, V)
  for n, start in enumerate(STARTS):
    want = torch_block_logits(model, stored, CONFIG, HISTORY, start + 1)
    np.testing.assert_allclose(got[n], want, rtol=1e-4, atol=1e-4)


def test_greedy_output_is_autoregressive(hf, folder):
  _, target = hf
  drafter = io.load_drafter(folder, target, top_k=2, total_tokens=5)
  prompts = [HISTORY[:7], [5, 6, 7, 5, 6]]
  ar = specjax.generate(target, prompts, max_new_tokens=14, pad_to=16).tokens
  assert specjax.generate(target, prompts, max_new_tokens=14, pad_to=16,
                          drafter=drafter).tokens == ar


# ------------------------------------------------------------------------------------------------
# 2. Writing back


def _round_trip(drafter, target, path, dtype=None):
  io.export_drafter(path, drafter, target, "dflash", dtype=dtype)
  assert formats.detect(path) == "dflash"
  back = io.load_drafter(path, target)
  assert back.hidden_layers == drafter.hidden_layers
  assert back.net.mask_token_id == drafter.net.mask_token_id
  assert back.net.block_size == drafter.net.block_size
  np.testing.assert_array_equal(np.asarray(back.d2t), np.asarray(drafter.d2t))
  return back


def test_write_back_round_trip(hf, folder, tmp_path):
  _, target = hf
  drafter = io.load_drafter(folder, target)
  back = _round_trip(drafter, target, tmp_path / "out")
  a, b = flat(drafter), flat(back)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  with open(tmp_path / "out" / "config.json") as f:
    written = json.load(f)
  assert written["architectures"] == ["DFlashDraftModel"]
  assert written["dflash_config"] == CONFIG["dflash_config"]
  assert written["num_hidden_layers"] == 2 and written["head_dim"] == 16
  with safe_open(tmp_path / "out" / "model.safetensors", framework="numpy") as f:
    assert set(f.keys()) == set(published_tensors())  # the published names exactly


def test_own_mask_embedding_and_d2t_round_trip(hf, tmp_path):
  """A drafter with its own mask vector (no mask_token_id) and a draft vocabulary: the vector
  is written as the extra `mask_embedding` tensor, d2t as offsets; bfloat16 export."""
  _, target = hf
  d2t = np.arange(0, V, 3)[::-1].copy()
  drafter = io.init_drafter("dflash", target, d2t=d2t)
  assert drafter.net.mask_token_id is None
  back = _round_trip(drafter, target, tmp_path / "own", dtype="bfloat16")
  a, b = flat(drafter), flat(back)
  assert "mask_embedding" in b
  for k in a:
    want = np.asarray(jnp.asarray(a[k]).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(b[k], want, err_msg=k)


def test_mask_embedding_tensor_overrides_the_mask_row(hf, tensors, tmp_path):
  """A `mask_embedding` tensor next to a mask_token_id is the mask vector itself."""
  _, target = hf
  vec = torch.linspace(-1.0, 1.0, H)
  drafter = io.load_drafter(publish(tmp_path / "m", {**tensors, "mask_embedding": vec}), target)
  assert drafter.net.mask_token_id is None
  np.testing.assert_array_equal(flat(drafter)["mask_embedding"], vec.numpy())


# ------------------------------------------------------------------------------------------------
# 3. Bad folders


def _drop(name):
  return lambda t, c: t.pop(name)


def _set(*keys, value):
  def edit(t, c):
    d = c
    for k in keys[:-1]:
      d = d[k]
    d[keys[-1]] = value
  return edit


BAD = {
    "missing": (_drop("layers.1.mlp.up_proj.weight"), "lacks tensor 'layers.1.mlp.up_proj"),
    "unexpected": (lambda t, c: t.update({"lm_head.weight": torch.zeros(V, H)}),
                   r"does not use: \['lm_head.weight'\]"),
    "shape": (lambda t, c: t.update({"layers.0.self_attn.k_norm.weight": torch.ones(8)}),
              "k_norm.weight' .* has shape"),
    "fc shape": (lambda t, c: t.update({"fc.weight": torch.zeros(H, 2 * H + 1)}),
                 r"fc.weight has shape \(64, 129\)"),
    "fc bias": (lambda t, c: t.update({"fc.bias": torch.zeros(H)}), "fc bias"),
    "hidden size": (_set("hidden_size", value=32), "hidden_size is 32, the target's 64"),
    "vocab": (_set("vocab_size", value=1000), "vocab_size has 1000 rows, the target's"),
    "mask id": (_set("dflash_config", "mask_token_id", value=V), "mask_token_id 211 is outside"),
    "no mask": (lambda t, c: c["dflash_config"].pop("mask_token_id"), "no mask_token_id"),
    "taps": (_set("dflash_config", "target_layer_ids", value=[0, 1, 4]),
             r"target layer ids \[4\] fall outside"),
    "tap count": (_set("dflash_config", "target_layer_ids", value=[0, 1]),
                  "fc fuses 3 taps, the config names 2"),
    "target depth": (_set("num_target_layers", value=36), "target of 36 layers"),
    "block size": (lambda t, c: c.pop("block_size"), "no block_size"),
    "mask shape": (lambda t, c: t.update({"mask_embedding": torch.zeros(H + 1)}),
                   "'mask_embedding' .* has shape"),
    "sliding": (_set("layer_types", value=["sliding_attention", "full_attention"]),
                "only full-attention"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_folders_are_refused_by_name(hf, tensors, tmp_path, case):
  _, target = hf
  edit, match = BAD[case]
  t, c = dict(tensors), copy.deepcopy(CONFIG)
  edit(t, c)
  path = publish(tmp_path / "bad", t, c)
  with pytest.raises(ValueError, match=match):
    io.load_drafter(path, target, format="dflash")


def test_missing_layer_ids_use_the_reference_guess(hf, tmp_path):
  """One draft layer over L layers taps the output of layer L // 2 (index L // 2 + 1)."""
  _, target = hf
  c = copy.deepcopy(CONFIG)
  c.update(num_hidden_layers=1, layer_types=["full_attention"],
           dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [0]})
  t = published_tensors(c)
  del c["dflash_config"]["target_layer_ids"]
  path = publish(tmp_path / "guess", t, c)
  with pytest.warns(UserWarning, match="the reference's guess"):
    drafter = io.load_drafter(path, target)
  assert drafter.hidden_layers == (L // 2 + 1,)
  assert dflash_format.reference_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # SpecForge's Qwen3-8B taps
