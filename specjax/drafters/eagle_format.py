"""EAGLE-1/2 heads in their authors' layout (`ea_layer` of EAGLE's cnets1.py) -> the `eagle` family.

config.json: a Llama- or Qwen2-style model dict of the draft layer (`hidden_size`, heads,
`intermediate_size`, RoPE, `rms_norm_eps`, `vocab_size`: the target's), and two EAGLE keys:
`bias` (fc's bias; absent means true, EAGLE's default; the Llama-3 heads set false) and
`qkv_bias` (biases on q/k/v, as the Qwen2 heads have; absent: read from the tensors). The head
dimension is always hidden_size / num_attention_heads, as EAGLE builds the layer.

Tensors (torch layout, [out, in]):

  embed_tokens.weight                          [V, H]   saved (the target's, frozen); checked
  fc.weight, fc.bias                           [H, 2H], [H]  input [embedding | feature]
  layers.0.self_attn.{q,k,v}_proj.weight       [., H]   (+ .bias with qkv_bias)
  layers.0.self_attn.o_proj.weight             [H, H]
  layers.0.post_attention_layernorm.weight     [H]
  layers.0.mlp.{gate,up,down}_proj.weight

Layer 0 has no input_layernorm and there is no lm_head: the head drafts through the target's own
LM head over the whole vocabulary (d2t = the identity). The feature is the target's final normed
hidden state (specjax's hidden index L, the LM head's input). Heads of more than one layer
(`layers.1.*`, each with an input norm) are refused: specjax's eagle family has one draft layer.

Written back in the same layout (config.json + model.safetensors), with the target's embedding,
so EAGLE's own loader reads it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from specjax.drafters import format_common as common
from specjax.drafters import formats, learned
from specjax.drafters.eagle import EagleConfig, EagleNet

EMBED = "embed_tokens.weight"
# Our param path prefix -> the published one (the first match applies).
_NAMES = (
    ("layer.post_attention_layernorm.", "layers.0.post_attention_layernorm."),
    ("layer.mlp.", "layers.0.mlp."),
    ("layer.", "layers.0.self_attn."),
    ("fc.", "fc."),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"layers\.(\d+)\.")


def published_name(ours: str) -> str:
  """e.g. "layer.q_proj.kernel" -> "layers.0.self_attn.q_proj.weight"."""
  return common.renamed(ours, _NAMES, "EAGLE")


def read_params(ckpt: common.Checkpoint, net: EagleConfig) -> Any:
  """The network's params from published tensors (kernels transposed, shapes checked)."""
  return common.read_params(ckpt, EagleNet, net, published_name)


def layer_model_config(config: dict[str, Any], ckpt: common.Checkpoint, target_cfg, where: str):
  """The draft layer's ModelConfig as EAGLE builds it: head_dim = H / heads, q/k/v biases only
  (from `qkv_bias`, else from the tensors), no o/MLP bias, no q/k norm."""
  layers = {int(m.group(1)) for n in ckpt.names() if (m := _LAYER.match(n))}
  n_layers = int(config.get("num_hidden_layers", 1))
  if n_layers != 1 or layers - {0}:
    raise ValueError(f"{where}: an EAGLE head of {max(n_layers, len(layers))} layers "
                     f"(config num_hidden_layers {n_layers}, tensors of layers {sorted(layers)}); "
                     "specjax's eagle family has one draft layer")
  d = dict(config)
  hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
  if not hidden or not heads or hidden % heads:
    raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                     f"{heads} (EAGLE's head dimension is their ratio)")
  if d.get("head_dim") not in (None, hidden // heads):
    raise ValueError(f"{where}: head_dim {d['head_dim']} differs from hidden_size / "
                     f"num_attention_heads = {hidden // heads}, the head dimension EAGLE's "
                     "layer uses")
  d["head_dim"] = hidden // heads
  if "qkv_bias" in config:
    qkv_bias = bool(config["qkv_bias"])
  else:
    qkv_bias = "layers.0.self_attn.q_proj.bias" in ckpt
  model = common.draft_model_config(d, target_cfg, where)
  return model.replace(num_layers=1, qkv_bias=qkv_bias, o_bias=False, mlp_bias=False,
                       qk_norm=False)


class EagleFormat(formats.Format):
  name = "eagle"
  method = "eagle"

  def matches(self, config, tensors) -> bool:
    if config is not None and "dflash_config" in config:
      return False
    other = ("midlayer.", "model.", "hidden_norm.", "norm.", "lm_head.",
             "layers.0.input_layernorm.")
    return ("fc.weight" in tensors and any(t.startswith("layers.") for t in tensors)
            and not any(t.startswith(other) for t in tensors))

  def read(self, ckpt, target):
    cfg, where = target.config, ckpt.path
    config = ckpt.config
    if config is None:
      raise ValueError(f"{where}: an EAGLE head needs its config.json")
    model = layer_model_config(config, ckpt, cfg, where)
    common.check_vocab("vocab_size", int(config.get("vocab_size", cfg.vocab_size)), cfg, where)
    h = cfg.hidden_size
    fc = ckpt.shapes.get("fc.weight")
    if fc != (h, 2 * h):
      raise ValueError(f"{where}: fc.weight has shape {fc}, expected [H, 2H] = [{h}, {2 * h}] "
                       "(the target's width H)")
    fc_bias = bool(config.get("bias", True))
    if fc_bias != ("fc.bias" in ckpt):
      how = "given" if "bias" in config else "absent: EAGLE defaults to true"
      raise ValueError(f"{where}: config bias is {fc_bias} ({how}) but the checkpoint "
                       f"{'lacks' if fc_bias else 'has'} fc.bias")
    if EMBED in ckpt:
      shape = ckpt.shapes[EMBED]
      if shape != (cfg.vocab_size, h):
        raise ValueError(f"{where}: {EMBED} has shape {shape}, the target's embedding "
                         f"{(cfg.vocab_size, h)}: it was made for another target")
      common.check_embedding(ckpt, target, (EMBED,))
    net = EagleConfig(model, fc_bias)
    params = read_params(ckpt, net)
    ckpt.check_all_used(n for n in ckpt.names() if n.endswith(_IGNORED_SUFFIXES))
    d2t = np.arange(cfg.vocab_size, dtype=np.int32)
    source = {"format": self.name, "files": ckpt.files,
              "feature": "the target's final normed hidden state (index L)",
              "embedding": "saved, equal to the target's" if EMBED in ckpt else
              "absent: the target's"}
    return common.Converted(self.method, net, params, d2t, (cfg.num_layers,), {}, source)

  def write(self, path, drafter, target, dtype=None):
    target_cfg = target.config
    net, m = drafter.net, drafter.net.model
    common.check_not_gemma_layers(drafter.net.model, "eagle")
    where = f"cannot write this eagle drafter in EAGLE's layout ({path})"
    if tuple(int(i) for i in drafter.hidden_layers) != (target_cfg.num_layers,):
      raise ValueError(f"{where}: it reads hidden states {list(drafter.hidden_layers)}, the "
                       f"layout only the final normed state ({target_cfg.num_layers})")
    d2t = np.asarray(drafter.d2t)
    if not np.array_equal(d2t, np.arange(target_cfg.vocab_size)):
      raise ValueError(f"{where}: its draft vocabulary has {d2t.size} of the target's "
                       f"{target_cfg.vocab_size} ids; EAGLE-1/2 heads draft over the whole "
                       "vocabulary")
    if m.qk_norm or m.o_bias or m.mlp_bias:
      raise ValueError(f"{where}: its layer has q/k norms, an o_proj or MLP bias (a Qwen3 "
                       "target's layer), which EAGLE's layer lacks")
    if m.head_dim * m.num_heads != m.hidden_size:
      raise ValueError(f"{where}: head_dim {m.head_dim} x {m.num_heads} heads is not "
                       f"hidden_size {m.hidden_size}, as EAGLE's layer requires")
    arch = "qwen2" if m.architecture == "qwen2" else "llama"
    config = m.replace(num_layers=1, architecture=arch,
                       vocab_size=target_cfg.vocab_size).to_hf_dict()
    for key in ("bos_token_id", "eos_token_id"):
      config.pop(key, None)
    config.update(attention_bias=False, qkv_bias=bool(m.qkv_bias), bias=bool(net.fc_bias),
                  tie_word_embeddings=False)
    tensors = {published_name(k): common.torch_layout(k, v)
               for k, v in common.flat_params(drafter.params).items()}
    tensors[EMBED] = np.asarray(learned.target_embedding(target.config, target.params),
                                np.float32)
    common.write_weights(path, tensors, dtype)
    common.write_json(path, common.CONFIG, config)


formats.register(EagleFormat())
