"""EAGLE-3 heads in the published layout (its authors' and SpecForge's) load into specjax.

  1. A random head written tensor by tensor as the layout documents (names, torch shapes, int64
     d2t offsets, bool t2d; float32 and bfloat16) drafts, at depth 1, the logits of an
     independent torch forward of that layout (fc over the fused taps, the one layer reading
     [normed embedding | normed feature] with the feature as residual, RoPE at the token's
     position, causal attention, norm, own LM head, target id = i + d2t[i]), within 1e-4 in
     float32, for both spellings of the tap ids (outputs of layers, nested in eagle_config; inputs
     of layers, top level) and for EAGLE's default capture.
  2. Greedy output with the loaded head equals autoregressive greedy, in float32 and bfloat16,
     and the head survives a write-back in the layout (export_drafter) with identical params.
  3. Detection among specjax's own folders and other layouts; a pickled `pytorch_model.bin` reads
     through torch; without torch it is refused with the way to convert it.
  4. Bad input, each a ValueError naming the problem: a missing, unexpected or misshapen tensor,
     a head for a wider target or another vocabulary, d2t outside the vocabulary, t2d that
     disagrees, an embedding that is not the target's, taps out of range, corrupt weights, a
     folder of no known layout.
"""

from __future__ import annotations

import builtins
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import specjax
from specjax.drafters import eagle3_format, formats, io, learned, registry
from specjax.models import decoder
from tests.helpers import torch_ref as tr

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

H, HEADS, KV, HD, INTER, VD = 64, 4, 2, 16, 80, 50
EPS, THETA = 1e-5, 5000.0
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 150, 3], [200, 1, 64, 64, 9]]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """A 4-layer tiny Llama target: (transformers model, specjax target, its folder)."""
  path = tmp_path_factory.mktemp("target")
  return (*tr.hf_target(path, num_hidden_layers=4), str(path))


def head_config(**changes) -> dict:
  cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
         "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
         "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1, "vocab_size": 211,
         "draft_vocab_size": VD, "rms_norm_eps": EPS, "rope_theta": THETA,
         "max_position_embeddings": 512, "hidden_act": "silu", "torch_dtype": "float16",
         "tie_word_embeddings": False,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                          "use_aux_hidden_state": True}}
  cfg.update(changes)
  return cfg


def head_tensors(seed: int = 0, vocab: int = 211) -> dict[str, torch.Tensor]:
  """A random head as the layout documents it: torch [out, in] weights, int64 d2t offsets."""
  g = torch.Generator().manual_seed(seed)

  def w(*shape, scale=0.15):
    return scale * torch.randn(*shape, generator=g)

  def norm():
    return 1.0 + 0.2 * torch.randn(H, generator=g)

  used = torch.sort(torch.randperm(vocab, generator=g)[:VD]).values
  t = {"fc.weight": w(H, 3 * H), "midlayer.hidden_norm.weight": norm(),
       "midlayer.input_layernorm.weight": norm(),
       "midlayer.self_attn.q_proj.weight": w(HEADS * HD, 2 * H),
       "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * H),
       "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * H),
       "midlayer.self_attn.o_proj.weight": w(H, HEADS * HD),
       "midlayer.post_attention_layernorm.weight": norm(),
       "midlayer.mlp.gate_proj.weight": w(INTER, H), "midlayer.mlp.up_proj.weight": w(INTER, H),
       "midlayer.mlp.down_proj.weight": w(H, INTER), "norm.weight": norm(),
       "lm_head.weight": w(VD, H, scale=0.5),
       "d2t": (used - torch.arange(VD)).to(torch.int64)}
  t2d = torch.zeros(vocab, dtype=torch.bool)
  t2d[used] = True
  t["t2d"] = t2d
  return t


def write_head(path, tensors=None, config=None, dtype=torch.float32, file="model.safetensors"):
  os.makedirs(path, exist_ok=True)
  tensors = head_tensors() if tensors is None else tensors
  tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
  if file.endswith(".safetensors"):
    safetensors_torch.save_file(tensors, os.path.join(path, file))
  else:
    torch.save(tensors, os.path.join(path, file))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(head_config() if config is None else config, f)
  return str(path)


def reference_logits(model, tensors, ids, taps) -> np.ndarray:
  """Depth-1 logits [T - 1, V] (target ids; -inf off the draft vocabulary) of the published
  EAGLE-3 forward, position t reading the taps' states at t and the embedding of ids[t + 1]."""
  w = {k: (v.double() if v.is_floating_point() else v) for k, v in tensors.items()}
  hs = tr.hidden_states(model, ids)
  t = len(ids) - 1
  h = torch.cat([hs[i][:t] for i in taps], -1) @ w["fc.weight"].T  # [T-1, H]
  emb = model.get_input_embeddings().weight.detach().double()[torch.tensor(ids[1:])]
  x = torch.cat([tr.rms_norm(emb, w["midlayer.input_layernorm.weight"], EPS),
                 tr.rms_norm(h, w["midlayer.hidden_norm.weight"], EPS)], -1)
  pos = torch.arange(t)
  a = "midlayer.self_attn."
  q = tr.rope((x @ w[a + "q_proj.weight"].T).view(t, HEADS, HD), pos, THETA)
  k = tr.rope((x @ w[a + "k_proj.weight"].T).view(t, KV, HD), pos, THETA)
  v = (x @ w[a + "v_proj.weight"].T).view(t, KV, HD)
  causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
  r = h + tr.attention(q, k, v, causal) @ w[a + "o_proj.weight"].T
  m = "midlayer.mlp."
  r = r + tr.swiglu(tr.rms_norm(r, w["midlayer.post_attention_layernorm.weight"], EPS),
                    w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
  draft = tr.rms_norm(r, w["norm.weight"], EPS) @ w["lm_head.weight"].T  # [T-1, Vd]
  ids_of = torch.arange(VD) + w["d2t"]
  out = torch.full((t, 211), float("-inf"), dtype=torch.float64)
  out[:, ids_of] = draft
  return out.numpy()


def specjax_logits(drafter, target, ids) -> np.ndarray:
  """specjax's depth-1 logits [T - 1, V] in target ids, from the family's training view (which
  the drafter's jitted rounds are tested to equal)."""
  fam = registry.family("eagle3")
  tokens = jnp.asarray([ids], jnp.int32)
  hidden = decoder.full_forward(target.config, target.params, tokens,
                                hidden_layers=drafter.hidden_layers).hidden
  feats = learned.concat_features(hidden)
  inputs = learned.DepthInputs(feats=feats, clean=feats, tokens=tokens,
                               emb=learned.target_embedding(target.config, target.params),
                               head=None)
  draft, _ = fam.depth_logits(drafter.net, drafter.params, inputs, 1)
  draft = np.asarray(draft[0, 0, :len(ids) - 1], np.float64)
  out = np.full((len(ids) - 1, 211), -np.inf)
  out[:, np.asarray(drafter.d2t)] = draft
  return out


# ------------------------------------------------------------------------------------------------
# 1. The published forward


@pytest.mark.parametrize("spelling", ["outputs", "inputs", "default"])
def test_depth1_logits_match_the_published_forward(hf, tmp_path, spelling):
  model, target, _ = hf
  config = head_config()
  if spelling == "inputs":  # vLLM's top-level ids count layer inputs: the same layers 1, 2, 3
    del config["eagle_config"]
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    taps = (1, 2, 3)
  elif spelling == "default":  # EAGLE's capture: inputs of layers 2, L // 2, L - 3
    del config["eagle_config"]
    taps = (2, 2, 1)
  else:
    taps = (1, 2, 3)
  tensors = head_tensors()
  drafter = specjax.load_drafter(write_head(tmp_path / "head", tensors, config), target)
  assert tuple(drafter.hidden_layers) == taps
  for ids in PROMPTS:
    want = reference_logits(model, tensors, ids, taps)
    got = specjax_logits(drafter, target, ids)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)],
                               rtol=1e-4, atol=1e-4)


def test_tap_conventions():
  """Both spellings of the ids, and the default, as specjax hidden-state indices."""
  nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
  assert eagle3_format.hidden_layers_of(nested, 32, "x")[0] == (2, 16, 29)
  top = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}
  assert eagle3_format.hidden_layers_of(top, 32, "x")[0] == (2, 16, 29)
  assert eagle3_format.hidden_layers_of({}, 32, "x")[0] == (2, 16, 29)
  assert eagle3_format.hidden_layers_of({"specjax_hidden_layers": [2, 4, 32]}, 32,
                                        "x")[0] == (2, 4, 32)


# ------------------------------------------------------------------------------------------------
# 2. Lossless, in float32 and bfloat16; written back


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_equals_autoregressive(hf, tmp_path, dtype):
  """In the dtype users run too: a bfloat16 head on the target loaded in bfloat16 (which
  computes in float32, and so does the drafter: `learned.drafter_dtype`)."""
  _, target, folder = hf
  if dtype == "bfloat16":
    target = specjax.load_target(folder, dtype="bfloat16")
  path = write_head(tmp_path / "head", dtype=getattr(torch, dtype))
  drafter = specjax.load_drafter(path, target, depth=4, top_k=3, total_tokens=10)
  assert target.config.dtype == dtype and drafter.net.dtype == "float32"
  ar = specjax.generate(target, PROMPTS, max_new_tokens=24).tokens
  assert specjax.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter).tokens == ar


def test_write_back_round_trip(hf, tmp_path):
  _, target, _ = hf
  drafter = specjax.load_drafter(write_head(tmp_path / "head"), target)
  io.export_drafter(tmp_path / "back", drafter, target, "eagle3")
  assert formats.detect(tmp_path / "back") == "eagle3"
  with safe_open(str(tmp_path / "back" / "model.safetensors"), framework="numpy") as f:
    assert set(f.keys()) == set(head_tensors())
    assert f.get_tensor("d2t").dtype == np.int64 and f.get_tensor("t2d").dtype == bool
  again = specjax.load_drafter(tmp_path / "back", target)
  assert tuple(again.hidden_layers) == tuple(drafter.hidden_layers)
  np.testing.assert_array_equal(np.asarray(again.d2t), np.asarray(drafter.d2t))
  for (k, a), (_, b) in zip(nnx.to_flat_state(drafter.params),
                            nnx.to_flat_state(again.params)):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(k))


# ------------------------------------------------------------------------------------------------
# 3. Detection and torch pickles


def test_detection_and_pickles(hf, tmp_path, monkeypatch):
  _, target, _ = hf
  assert formats.detect(io.asset_dir("eagle3")) == "specjax"
  path = write_head(tmp_path / "bin", file="pytorch_model.bin")
  assert formats.detect(path) == "eagle3"
  from_bin = specjax.load_drafter(path, target)
  from_st = specjax.load_drafter(write_head(tmp_path / "st"), target)
  for (_, a), (_, b) in zip(nnx.to_flat_state(from_bin.params),
                            nnx.to_flat_state(from_st.params)):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
  real_import = builtins.__import__

  def no_torch(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
      raise ImportError("No module named 'torch'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_torch)
  with pytest.raises(ValueError, match="torch is not installed.*safetensors"):
    specjax.load_drafter(path, target, format="eagle3")


# ------------------------------------------------------------------------------------------------
# 4. Bad input


def _drop(name):
  return lambda t, c: (t.pop(name), (t, c))[1]


def _set(name, value):
  return lambda t, c: (t.__setitem__(name, value), (t, c))[1]


def _conf(**changes):
  return lambda t, c: (t, {**c, **changes})


BAD = {
    "missing": (_drop("midlayer.mlp.down_proj.weight"), "lacks tensor 'midlayer.mlp.down_proj"),
    "unexpected": (_set("midlayer.extra.weight", torch.ones(3)), "does not use.*midlayer.extra"),
    "shape": (_set("lm_head.weight", torch.ones(VD, H // 2)), "lm_head.weight.*has shape"),
    "wider target": (_conf(hidden_size=2 * H), "hidden_size is 128, the target's 64"),
    "vocab": (_conf(vocab_size=300), "vocab_size has 300 rows, the target's vocabulary 211"),
    "d2t range": (_set("d2t", torch.full((VD,), 500, dtype=torch.int64)),
                  "outside the target vocabulary"),
    "t2d": (_set("t2d", torch.ones(211, dtype=torch.bool)), "t2d disagrees with d2t"),
    "embedding": (_set("embed_tokens.weight", torch.randn(211, H)),
                  "embed_tokens.weight differs from the target's embedding"),
    "taps": (_conf(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}),
             r"taps \[1, 2, 10\].*outside the target's hidden states \[0, 4\]"),
    "fc taps": (_conf(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]}),
                "fc fuses 3 taps, the config names 2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_heads_are_refused_by_name(hf, tmp_path, case):
  _, target, _ = hf
  change, message = BAD[case]
  tensors, config = change(head_tensors(), head_config())
  with pytest.raises(ValueError, match=message):
    specjax.load_drafter(write_head(tmp_path / "head", tensors, config), target)


def test_corrupt_and_unknown_folders(hf, tmp_path):
  _, target, _ = hf
  path = write_head(tmp_path / "head")
  with open(os.path.join(path, "model.safetensors"), "wb") as f:
    f.write(b"not a safetensors file")
  with pytest.raises(ValueError, match="corrupt safetensors file"):
    specjax.load_drafter(path, target, format="eagle3")
  other = tmp_path / "other"
  other.mkdir()
  (other / "config.json").write_text(json.dumps({"hello": 1}))
  with pytest.raises(ValueError, match="not a drafter folder of a known format"):
    specjax.load_drafter(other, target)
  with pytest.raises(ValueError, match="unknown drafter format 'eagle9'"):
    specjax.load_drafter(path, target, format="eagle9")
