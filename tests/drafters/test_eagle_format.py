"""EAGLE-1/2 heads in their published layout (`specjax.drafters.eagle_format`).

Random heads are written as their authors save them (config.json with `bias` / `qkv_bias`, a
torch pickle or safetensors of `embed_tokens`, `fc`, `layers.0.*` without an input norm), for tiny
HF targets. The reference forward is torch, written here from the layout's description: fc over
[embedding | final normed feature], one Llama decoder layer without its input norm (causal
attention with RoPE over the prefix, SwiGLU), then the target's LM head.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

import specjax  # noqa: E402
from specjax.drafters import formats, io, learned  # noqa: E402
from tests.helpers import torch_ref  # noqa: E402

IDS = [5, 17, 42, 3, 99, 150, 7, 64, 23, 11, 200, 31]


def published_head(model, *, bias: bool, qkv_bias: bool, heads: int, kv_heads: int,
                   inter: int = 80, theta: float = 5000.0, model_type: str = "llama",
                   dtype=torch.float32, seed: int = 1):
  """(config, tensors) of a random EAGLE-1/2 head for the HF `model`, in EAGLE's layout."""
  cfg = model.config
  h, d = cfg.hidden_size, cfg.hidden_size // heads
  g = torch.Generator().manual_seed(seed)

  def rand(*shape, scale=0.08):
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

  t = {"embed_tokens.weight": model.model.embed_tokens.weight.detach().to(dtype),
       "fc.weight": rand(h, 2 * h)}
  if bias:
    t["fc.bias"] = rand(h)
  p = "layers.0."
  for name, out in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
    t[f"{p}self_attn.{name}_proj.weight"] = rand(out, h)
    if qkv_bias:
      t[f"{p}self_attn.{name}_proj.bias"] = rand(out, scale=0.3)
  t[f"{p}self_attn.o_proj.weight"] = rand(h, heads * d)
  t[f"{p}mlp.gate_proj.weight"] = rand(inter, h)
  t[f"{p}mlp.up_proj.weight"] = rand(inter, h)
  t[f"{p}mlp.down_proj.weight"] = rand(h, inter)
  t[f"{p}post_attention_layernorm.weight"] = (1.0 + rand(h, scale=0.2)).to(dtype)
  config = {"architectures": ["LlamaForCausalLM"], "model_type": model_type,
            "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "hidden_act": "silu",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": theta,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."), "bias": bias}
  if qkv_bias:
    config["qkv_bias"] = True
  return config, t


def save_head(path, config, tensors, kind: str) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if kind == "bin":
    torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
  else:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
  return os.fspath(path)


def reference_logits(model, config, tensors, ids) -> np.ndarray:
  """[T - 1, V] float64: row t is the head at position t reading (e(x_{t+1}), f_t), through
  the target's LM head (the distribution of x_{t+2})."""
  w = {k: v.double() for k, v in tensors.items()}
  f = torch_ref.hidden_states(model, ids)[-1]  # the final normed state
  emb = model.model.embed_tokens.weight.detach().double()[torch.tensor(ids[1:])]
  x = torch.cat([emb, f[:-1]], -1) @ w["fc.weight"].T
  if config["bias"]:
    x = x + w["fc.bias"]
  n, heads, kv = x.shape[0], config["num_attention_heads"], config["num_key_value_heads"]
  d = config["hidden_size"] // heads
  p = "layers.0.self_attn."

  def proj(name, count):
    y = x @ w[f"{p}{name}_proj.weight"].T
    if config.get("qkv_bias"):
      y = y + w[f"{p}{name}_proj.bias"]
    return y.reshape(n, count, d)

  pos = torch.arange(n)
  q = torch_ref.rope(proj("q", heads), pos, config["rope_theta"])
  k = torch_ref.rope(proj("k", kv), pos, config["rope_theta"])
  attn = torch_ref.attention(q, k, proj("v", kv), torch.ones(n, n, dtype=torch.bool).tril())
  x = x + attn @ w[f"{p}o_proj.weight"].T
  m = "layers.0.mlp."
  y = torch_ref.rms_norm(x, w["layers.0.post_attention_layernorm.weight"], config["rms_norm_eps"])
  x = x + torch_ref.swiglu(y, w[f"{m}gate_proj.weight"], w[f"{m}up_proj.weight"],
                           w[f"{m}down_proj.weight"])
  return (x @ model.lm_head.weight.detach().double().T).numpy()


def depth1_logits(drafter, target, model, ids) -> np.ndarray:
  """specjax's training view of the loaded drafter at depth 1 on the target's (torch) features."""
  fam = io.family("eagle")
  f = torch_ref.hidden_states(model, ids)[-1].float().numpy()[None]
  x = learned.DepthInputs(jnp.asarray(f), jnp.asarray(f), jnp.asarray([ids], jnp.int32),
                          learned.target_embedding(target.config, target.params), drafter.head)
  logits, _ = fam.depth_logits(drafter.net, drafter.params, x, 1)
  return np.asarray(logits[0, 0, :-1], np.float64)


# variant, head options, file kind
CASES = {
    "llama_bin_bias": ("llama_gqa_tied", dict(bias=True, qkv_bias=False, heads=4, kv_heads=4),
                       "bin"),
    "llama_st_nobias": ("llama_mha", dict(bias=False, qkv_bias=False, heads=2, kv_heads=1,
                                          dtype=torch.float16), "safetensors"),
    "qwen2_qkv_bias": ("qwen2_bias", dict(bias=True, qkv_bias=True, heads=4, kv_heads=2,
                                          model_type="qwen2"), "safetensors"),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
  cache = {}

  def get(variant):
    if variant not in cache:
      cache[variant] = torch_ref.hf_target(tmp_path_factory.mktemp(variant), variant)
    return cache[variant]

  return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_published_head_matches_torch_reference(case, targets, tmp_path):
  variant, opts, kind = CASES[case]
  model, target = targets(variant)
  config, tensors = published_head(model, **opts)
  path = save_head(tmp_path / "head", config, tensors, kind)
  assert formats.detect(path) == "eagle"
  drafter = io.load_drafter(path, target)
  assert drafter.hidden_layers == (target.config.num_layers,)
  np.testing.assert_array_equal(np.asarray(drafter.d2t), np.arange(target.config.vocab_size))
  want = reference_logits(model, config, tensors, IDS)
  got = depth1_logits(drafter, target, model, IDS)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

  # Written back in the published layout, then read again: the same params.
  out = tmp_path / "out"
  io.export_drafter(out, drafter, target, "eagle")
  assert formats.detect(out) == "eagle"
  from safetensors.numpy import load_file
  written = load_file(os.fspath(out / "model.safetensors"))
  assert set(written) == set(tensors)
  np.testing.assert_array_equal(written["embed_tokens.weight"],
                                model.model.embed_tokens.weight.detach().float().numpy())
  with open(out / "config.json") as f:
    assert json.load(f)["bias"] is opts["bias"]
  again = io.load_drafter(out, target)
  assert again.net == drafter.net
  a, b = (dict(nnx.to_flat_state(d.params)) for d in (drafter, again))
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(np.asarray(a[key][...]), np.asarray(b[key][...]))


def test_greedy_generation_with_a_loaded_head_is_the_targets(targets, tmp_path):
  model, target = targets("llama_gqa_tied")  # the head has 4 K/V heads, the target 2
  config, tensors = published_head(model, bias=True, qkv_bias=False, heads=4, kv_heads=4)
  drafter = io.load_drafter(save_head(tmp_path, config, tensors, "bin"), target, depth=3,
                            top_k=2, total_tokens=4)
  prompts = [IDS[:7], IDS[2:]]
  plain = specjax.generate(target, prompts, max_new_tokens=12, pad_to=16).tokens
  spec = specjax.generate(target, prompts, max_new_tokens=12, pad_to=16, drafter=drafter)
  assert spec.tokens == plain


def test_detection_tells_eagle_from_other_layouts():
  fmt = formats.get("eagle")
  eagle = frozenset({"embed_tokens.weight", "fc.weight", "layers.0.self_attn.q_proj.weight",
                     "layers.0.post_attention_layernorm.weight"})
  assert fmt.matches({"bias": True}, eagle)
  assert not fmt.matches({}, frozenset({"fc.weight", "midlayer.self_attn.q_proj.weight",
                                        "midlayer.hidden_norm.weight", "lm_head.weight"}))
  dflash = frozenset({"fc.weight", "hidden_norm.weight", "norm.weight",
                      "layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight"})
  assert not fmt.matches({"dflash_config": {}}, dflash)
  assert not fmt.matches({}, dflash)
  assert not fmt.matches({"dflash_config": {}}, eagle)
  assert not fmt.matches({}, frozenset({"model.embed_tokens.weight", "lm_head.weight",
                                        "model.layers.0.self_attn.q_proj.weight"}))


def _broken(model, change):
  config, tensors = published_head(model, bias=True, qkv_bias=False, heads=4, kv_heads=2)
  change(config, tensors)
  return config, tensors


def _add(name, value):
  return lambda c, t: t.__setitem__(name, value)


def _cfg(**kv):
  return lambda c, t: c.update(kv)


def _two_layers(c, t):
  c["num_hidden_layers"] = 2
  for k in list(t):
    if k.startswith("layers.0."):
      t[k.replace("layers.0.", "layers.1.")] = t[k].clone()
  t["layers.1.input_layernorm.weight"] = torch.ones(64)


ERRORS = {
    "missing": (lambda c, t: t.pop("layers.0.mlp.up_proj.weight"), "lacks tensor"),
    "unexpected": (_add("layers.0.self_attn.extra.weight", torch.zeros(3)),
                   "does not use"),
    "fc_shape": (_add("fc.weight", torch.zeros(64, 192)), "fc.weight has shape"),
    "q_shape": (_add("layers.0.self_attn.q_proj.weight", torch.zeros(60, 64)), "has shape"),
    "hidden": (_cfg(hidden_size=32, num_attention_heads=2), "hidden_size is 32"),
    "vocab": (_cfg(vocab_size=100), "vocabulary 211"),
    "embed_shape": (_add("embed_tokens.weight", torch.zeros(100, 64)), "another target"),
    "embed_values": (lambda c, t: t.__setitem__("embed_tokens.weight",
                                                t["embed_tokens.weight"] + 0.5),
                     "differs from the target's embedding"),
    "bias_false": (_cfg(bias=False), "checkpoint has fc.bias"),
    "bias_absent": (lambda c, t: (c.pop("bias"), t.pop("fc.bias")), "EAGLE defaults to true"),
    "head_dim": (_cfg(head_dim=8), "head_dim 8"),
    "two_layers": (_two_layers, "one draft layer"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_clear_errors(case, targets, tmp_path):
  model, target = targets("llama_gqa_tied")
  change, message = ERRORS[case]
  path = save_head(tmp_path, *_broken(model, change), "safetensors")
  with pytest.raises(ValueError, match=message):
    io.load_drafter(path, target, format="eagle")


def test_input_norm_on_layer0_is_not_this_layout(targets, tmp_path):
  model, target = targets("llama_gqa_tied")
  path = save_head(tmp_path, *_broken(model, _add("layers.0.input_layernorm.weight",
                                                  torch.ones(64))), "safetensors")
  with pytest.raises(ValueError, match="not a drafter folder of a known format"):
    formats.detect(path)
  with pytest.raises(ValueError, match="does not use.*input_layernorm"):
    io.load_drafter(path, target, format="eagle")


def test_writing_needs_the_whole_vocabulary_and_an_eagle_drafter(targets, tmp_path):
  _, target = targets("llama_gqa_tied")
  small = io.init_drafter("eagle", target, d2t=np.arange(50))
  with pytest.raises(ValueError, match="whole vocabulary"):
    io.export_drafter(tmp_path / "a", small, target, "eagle")
  full = io.init_drafter("eagle", target)
  with pytest.raises(ValueError, match="the eagle layout holds eagle drafters"):
    formats.write(tmp_path / "b", io.init_drafter("eagle3", target), target, "eagle")
  formats.write(tmp_path / "b", full, target, "eagle")
  assert formats.detect(tmp_path / "b") == "eagle"
