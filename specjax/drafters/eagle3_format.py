"""EAGLE-3 heads in the layout of their authors and of SpecForge -> the `eagle3` family.

config.json: a Llama-style model dict of the one draft layer (`hidden_size`, heads, `head_dim`,
`intermediate_size`, RoPE, `rms_norm_eps`), `vocab_size` (the target's) and `draft_vocab_size`;
architectures `LlamaForCausalLM` or `LlamaForCausalLMEagle3`.

Tensors (torch layout, [out, in]):

  fc.weight                                   [H, n H]  the n fused taps, low layer first
  midlayer.input_layernorm.weight             [H]       on the token embedding
  midlayer.hidden_norm.weight                 [H]       on the fused feature
  midlayer.self_attn.{q,k,v}_proj.weight      [., 2H]   input [normed embedding | normed h]
  midlayer.self_attn.o_proj.weight            [H, H]
  midlayer.post_attention_layernorm.weight    [H]
  midlayer.mlp.{gate,up,down}_proj.weight
  norm.weight, lm_head.weight                 [H], [Vd, H]
  d2t                                         int64[Vd] offsets: target id = i + d2t[i]
  t2d                                         bool[V] (derived from d2t; checked, not kept)

The embedding (`embed_tokens.weight`) is usually absent: the head drafts with the target's. When
present it must equal the target's. A Qwen3-style layer with `midlayer.self_attn.{q,k}_norm`
(model_type qwen3) is read too; specjax writes one for its own Qwen3-tapped heads.

Taps. Publishers spell the fused layers in two conventions, both read here (specjax's index
h = the output of layer h, 0 the embeddings, L the final normed state):
  - `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang, SpecForge): outputs of layers,
    h = id + 1;
  - top-level `eagle_aux_hidden_state_layer_ids` (vLLM): inputs of layers, h = id;
  - neither: EAGLE's own capture, the inputs of layers 2, L // 2 and L - 3.
`specjax_hidden_layers`, which specjax writes, names the indices exactly (the final normed state
L has no id in either convention).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specjax.drafters import format_common as common
from specjax.drafters import formats
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Net

# Our param path prefix -> the published one (the first match applies).
_NAMES = (
    ("hidden_norm.", "midlayer.hidden_norm."),
    ("input_layernorm.", "midlayer.input_layernorm."),
    ("layer.post_attention_layernorm.", "midlayer.post_attention_layernorm."),
    ("layer.mlp.", "midlayer.mlp."),
    ("layer.", "midlayer.self_attn."),
    ("fc.", "fc."),
    ("norm.", "norm."),
    ("lm_head.", "lm_head."),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def published_name(ours: str) -> str:
  """e.g. "layer.q_proj.kernel" -> "midlayer.self_attn.q_proj.weight"."""
  return common.renamed(ours, _NAMES, "EAGLE-3")


def read_params(ckpt: common.Checkpoint, net) -> Any:
  """The network's params from published tensors (kernels transposed, shapes checked)."""
  return common.read_params(ckpt, Eagle3Net, net, published_name)


def hidden_layers_of(config: dict[str, Any], num_layers: int, where: str
                     ) -> tuple[tuple[int, ...], str]:
  """specjax's hidden-state indices of the fused taps, and the convention they were read in."""
  nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  if config.get("specjax_hidden_layers") is not None:
    layers, how = config["specjax_hidden_layers"], "specjax_hidden_layers (specjax indices)"
  elif nested is not None:
    layers = [int(i) + 1 for i in nested]
    how = "eagle_config.eagle_aux_hidden_state_layer_ids: outputs of layers (index = id + 1)"
  elif config.get("eagle_aux_hidden_state_layer_ids") is not None:
    layers = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    how = "eagle_aux_hidden_state_layer_ids: inputs of layers (index = id)"
  else:
    layers = [2, num_layers // 2, num_layers - 3]
    how = "EAGLE's default capture: inputs of layers 2, L // 2, L - 3"
  bad = [i for i in layers if not 0 <= i <= num_layers]
  if bad:
    raise ValueError(f"{where}: taps {layers} (from {how}) fall outside the target's hidden "
                     f"states [0, {num_layers}]")
  return tuple(layers), how


def vocab_map(ckpt: common.Checkpoint, draft_vocab: int, vocab: int) -> np.ndarray:
  """int32[Vd] target ids from `d2t` offsets (the identity when the draft vocabulary is the
  target's and no d2t is stored); `t2d`, when present, must agree."""
  if "d2t" in ckpt:
    d2t = common.d2t_from_offsets(ckpt.get("d2t", (draft_vocab,)), vocab, ckpt.path)
  elif draft_vocab == vocab:
    d2t = np.arange(vocab, dtype=np.int32)
  else:
    raise ValueError(f"{ckpt.path}: draft_vocab_size {draft_vocab} < the target's {vocab} "
                     "but no d2t tensor maps draft ids to target ids")
  if "t2d" in ckpt:
    t2d = np.asarray(ckpt.get("t2d", (vocab,))).astype(bool)
    if not np.array_equal(t2d, common.t2d_of(d2t, vocab)):
      raise ValueError(f"{ckpt.path}: t2d disagrees with d2t (they name different draft "
                       "vocabularies)")
  return d2t


class Eagle3Format(formats.Format):
  name = "eagle3"
  method = "eagle3"

  def matches(self, config, tensors) -> bool:
    return "fc.weight" in tensors and any(t.startswith("midlayer.") for t in tensors)

  def read(self, ckpt, target):
    cfg, where = target.config, ckpt.path
    config = ckpt.config
    if config is None:
      raise ValueError(f"{where}: an EAGLE-3 head needs its config.json")
    if config.get("bias") or "fc.bias" in ckpt:
      raise ValueError(f"{where}: an fc bias is not part of EAGLE-3's layer (config bias=true)")
    model = common.draft_model_config(config, cfg, where).replace(num_layers=1)
    vocab = config.get("vocab_size", cfg.vocab_size)
    common.check_vocab("vocab_size", vocab, cfg, where)
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    fc = ckpt.shapes.get("fc.weight")
    if fc is None or len(fc) != 2 or fc[0] != cfg.hidden_size or fc[1] % cfg.hidden_size:
      raise ValueError(f"{where}: fc.weight has shape {fc}, expected [H, n H] with H = "
                       f"{cfg.hidden_size}")
    net = Eagle3Config(model, fc[1] // cfg.hidden_size, draft_vocab)
    params = read_params(ckpt, net)
    d2t = vocab_map(ckpt, draft_vocab, cfg.vocab_size)
    common.check_embedding(ckpt, target)
    ckpt.check_all_used({"d2t", "t2d", "embed_tokens.weight",
                         *(n for n in ckpt.names() if n.endswith(_IGNORED_SUFFIXES))})
    layers, how = hidden_layers_of(config, cfg.num_layers, where)
    if len(layers) != net.num_features:
      raise ValueError(f"{where}: fc fuses {net.num_features} taps, the config names "
                       f"{len(layers)} ({how})")
    return common.Converted(self.method, net, params, d2t, layers, {},
                            {"format": self.name, "files": ckpt.files, "taps": how})

  def write(self, path, drafter, target, dtype=None):
    target_cfg = target.config
    net = drafter.net
    layers = [int(h) for h in drafter.hidden_layers]
    common.check_not_gemma_layers(drafter.net.model, "eagle3")
    model = net.model.replace(num_layers=1).to_hf_dict()
    model.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="qwen3" if net.model.qk_norm else "llama",
        vocab_size=target_cfg.vocab_size, draft_vocab_size=net.draft_vocab_size,
        tie_word_embeddings=False, specjax_hidden_layers=layers)
    for key in ("bos_token_id", "eos_token_id"):
      model.pop(key, None)
    if all(1 <= h < target_cfg.num_layers for h in layers):  # expressible as layer outputs
      model["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [h - 1 for h in layers],
                               "use_aux_hidden_state": True}
    tensors = {published_name(k): common.torch_layout(k, v)
               for k, v in common.flat_params(drafter.params).items()}
    d2t = np.asarray(drafter.d2t)
    tensors["d2t"] = common.offsets_from_d2t(d2t)
    tensors["t2d"] = common.t2d_of(d2t, target_cfg.vocab_size)
    common.write_weights(path, tensors, dtype)
    common.write_json(path, common.CONFIG, model)


formats.register(Eagle3Format())
