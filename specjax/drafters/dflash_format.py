"""DFlash drafters in the layout of their authors (z-lab) and of SpecForge -> the `dflash` family.

config.json: a Qwen3-style model dict of the draft layers (`num_hidden_layers` of them,
`hidden_size` = the target's, heads, `head_dim`, `intermediate_size`, RoPE, `rms_norm_eps`,
`layer_types` all "full_attention"), `block_size` (B), `num_target_layers`, architectures
`DFlashDraftModel`, and

  dflash_config: {mask_token_id: the target embedding row embedded at the B - 1 masked
                  positions, target_layer_ids: the tapped target layers, low layer first}

Tensors (torch layout, [out, in]; per draft layer i):

  fc.weight                                     [H, n H]  the n fused taps, no bias
  hidden_norm.weight                            [H]       on the fused context
  layers.{i}.input_layernorm.weight             [H]       on the block (not the context)
  layers.{i}.self_attn.{q,k,v,o}_proj.weight
  layers.{i}.self_attn.{q_norm,k_norm}.weight   [head_dim]
  layers.{i}.post_attention_layernorm.weight    [H]
  layers.{i}.mlp.{gate,up,down}_proj.weight
  norm.weight                                   [H]       before the target's LM head
  d2t (optional)                                int64[Vd] offsets: target id = i + d2t[i]
  mask_embedding (specjax's, optional)          [H]       the mask vector itself

There is no embedding and no LM head: the drafter embeds with the target's table and scores the
target's whole vocabulary with the target's head (d2t = arange(V)), unless a `d2t` tensor (vLLM's
extension, EAGLE-3's offsets) restricts the head to a draft vocabulary. A saved
`embed_tokens.weight` must equal the target's.

The forward these tensors define is `specjax.drafters.dflash.DFlashNet`'s: ctx = hidden_norm(fc(
concat(taps))), once; in every layer the context's keys k_norm(k_proj(ctx)) and values
v_proj(ctx) (RoPE at the context's own positions, no input_layernorm) join the block's own keys
and values (input_layernorm'd, q/k-normed, RoPE'd at a .. a + B - 1); the block attends to all of
them non-causally; the final `norm`'s output goes through the target's head.

Taps. `target_layer_ids` count layer *outputs*: specjax's index h = id + 1 (0 the embeddings, L
the target's final normed state, which is HF's last `hidden_states` entry, as the reference reads
it). Without them the reference's own guess is used (warned: it is wrong for many published
drafters): n = 1 draft layer taps layer L // 2, else round(1 + i (L - 4) / (n - 1)), i < n.

The mask. A drafter trained with its own mask vector (specjax's `mask_embedding`, for a target
without a spare embedding row) has no `mask_token_id`, which the reference layout cannot express:
specjax writes the vector as an extra tensor `mask_embedding` and no `mask_token_id`, and reads it
back. A `mask_embedding` tensor next to a `mask_token_id` overrides that row (as vLLM's
`mask_embedding.pt` does). specjax's causal correction (`correction_rank`) has no published
counterpart and is not written. specjax writes no `auto_map` (the reference's modeling file
is not part of the folder).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from specjax.drafters import eagle3_format, formats
from specjax.drafters import format_common as common
from specjax.drafters.dflash import DFlashConfig, DFlashNet

ARCHITECTURE = "DFlashDraftModel"
MASK = "mask_embedding"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def published_name(ours: str) -> str:
  """Our dotted param path is the published tensor name, kernels as `.weight`
  (e.g. "layers.0.self_attn.q_proj.kernel" -> "layers.0.self_attn.q_proj.weight")."""
  return common.torch_name(ours)


def read_params(ckpt: common.Checkpoint, net: DFlashConfig) -> Any:
  """The network's params from published tensors (kernels transposed, shapes checked)."""
  return common.read_params(ckpt, DFlashNet, net, published_name)


def reference_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
  """The reference's taps when a config names none (layer ids, outputs of layers)."""
  if num_draft_layers == 1:
    return [num_target_layers // 2]
  span = num_target_layers - 4
  return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def hidden_layers_of(config: dict[str, Any], num_layers: int, num_draft_layers: int, where: str
                     ) -> tuple[tuple[int, ...], str]:
  """specjax's hidden-state indices of the fused taps, and how they were read."""
  ids = (config.get("dflash_config") or {}).get("target_layer_ids")
  if ids is not None:
    how = "dflash_config.target_layer_ids: outputs of layers (index = id + 1)"
  else:
    ids = reference_layer_ids(int(config.get("num_target_layers") or num_layers),
                              num_draft_layers)
    how = ("no target_layer_ids: the reference's guess for "
           f"{num_draft_layers} draft layers (outputs of layers {ids}, index = id + 1)")
    warnings.warn(f"{where}: {how}; published drafters often tap other layers",
                  stacklevel=3)
  if not isinstance(ids, (list, tuple)) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise ValueError(f"{where}: dflash_config.target_layer_ids must be a list of ints, got "
                     f"{ids!r}")
  layers = [i + 1 for i in ids]
  bad = [i for i in ids if not 0 <= i + 1 <= num_layers]
  if bad:
    raise ValueError(f"{where}: target layer ids {bad} fall outside the target's {num_layers} "
                     f"layers (ids -1 .. {num_layers - 1}: outputs of layers, from {how})")
  return tuple(layers), how


def _model_dict(config: dict[str, Any], ckpt: common.Checkpoint, where: str) -> dict[str, Any]:
  """The draft layers' model dict as a Qwen3 config (the reference's layers are Qwen3's)."""
  d = dict(config)
  d["model_type"] = "qwen3"
  if "num_hidden_layers" not in d:
    raise ValueError(f"{where}: config.json has no 'num_hidden_layers' (the draft layers)")
  if "head_dim" not in d and "layers.0.self_attn.q_norm.weight" in ckpt:
    d["head_dim"] = ckpt.shapes["layers.0.self_attn.q_norm.weight"][0]  # Qwen3: not H / heads
  kinds = set(d.get("layer_types") or ["full_attention"])
  if kinds != {"full_attention"}:
    raise ValueError(f"{where}: layer_types {sorted(kinds)}: only full-attention DFlash layers "
                     "are supported (no sliding windows)")
  if d.get("mlp_bias"):
    raise ValueError(f"{where}: mlp_bias is not part of DFlash's Qwen3 layers")
  return d


def _mask(ckpt: common.Checkpoint, config: dict[str, Any], vocab: int, hidden: int, where: str
          ) -> tuple[int | None, str]:
  mask_id = (config.get("dflash_config") or {}).get("mask_token_id")
  if MASK in ckpt:
    ckpt.get(MASK, (hidden,))  # its shape checked here; read_params reads it into the params
    over = "" if mask_id is None else f", overriding mask_token_id {mask_id}"
    return None, f"the {MASK} tensor (an own mask vector{over})"
  if mask_id is None:
    raise ValueError(f"{where}: dflash_config has no mask_token_id and the checkpoint no "
                     f"{MASK!r} tensor: nothing says what the masked positions embed")
  if not isinstance(mask_id, int) or isinstance(mask_id, bool) or not 0 <= mask_id < vocab:
    raise ValueError(f"{where}: dflash_config.mask_token_id {mask_id!r} is outside the target "
                     f"vocabulary [0, {vocab})")
  return mask_id, f"mask_token_id {mask_id} (the target's embedding row)"


class DFlashFormat(formats.Format):
  name = "dflash"
  method = "dflash"

  def matches(self, config, tensors) -> bool:
    if config is None or not any(t.startswith("layers.") for t in tensors):
      return False
    return "dflash_config" in config or ARCHITECTURE in (config.get("architectures") or ())

  def read(self, ckpt, target):
    cfg, where = target.config, ckpt.path
    config = ckpt.config
    if config is None:
      raise ValueError(f"{where}: a DFlash drafter needs its config.json")
    d = _model_dict(config, ckpt, where)
    model = common.draft_model_config(d, cfg, where)
    common.check_vocab("vocab_size", d["vocab_size"], cfg, where)
    if config.get("num_target_layers") not in (None, cfg.num_layers):
      raise ValueError(f"{where}: the drafter was made for a target of "
                       f"{config['num_target_layers']} layers (num_target_layers), this one "
                       f"has {cfg.num_layers}")
    block_size = config.get("block_size", (config.get("dflash_config") or {}).get("block_size"))
    if block_size is None:
      raise ValueError(f"{where}: config.json has no block_size")
    if "fc.bias" in ckpt:
      raise ValueError(f"{where}: an fc bias is not part of DFlash's fusion")
    e = cfg.hidden_size
    fc = ckpt.shapes.get("fc.weight")
    if fc is None or len(fc) != 2 or fc[0] != e or not fc[1] or fc[1] % e:
      raise ValueError(f"{where}: fc.weight has shape {fc}, expected [H, n H] with H = {e}")
    mask_id, mask_how = _mask(ckpt, config, cfg.vocab_size, e, where)
    draft_vocab = (ckpt.shapes["d2t"] or (0,))[0] if "d2t" in ckpt else cfg.vocab_size
    d2t = eagle3_format.vocab_map(ckpt, draft_vocab, cfg.vocab_size)
    net = DFlashConfig(model, fc[1] // e, int(block_size), int(d2t.size), mask_id)
    params = read_params(ckpt, net)
    common.check_embedding(ckpt, target)
    ckpt.check_all_used({"d2t", "t2d", "embed_tokens.weight",
                         *(n for n in ckpt.names() if n.endswith(_IGNORED_SUFFIXES))})
    layers, how = hidden_layers_of(config, cfg.num_layers, model.num_layers, where)
    if len(layers) != net.num_features:
      raise ValueError(f"{where}: fc fuses {net.num_features} taps, the config names "
                       f"{len(layers)} ({how})")
    return common.Converted(self.method, net, params, d2t, layers, {},
                            {"format": self.name, "files": ckpt.files, "taps": how,
                             "mask": mask_how})

  def write(self, path, drafter, target, dtype=None):
    target_cfg = target.config
    net = drafter.net
    m = net.model
    common.check_not_gemma_layers(drafter.net.model, "dflash")
    if net.correction_rank:
      raise ValueError("a DFlash drafter with a causal correction (correction_rank "
                       f"{net.correction_rank}) has no published layout")
    if net.anchor_feature:
      raise ValueError("a DFlash drafter with the anchor feature (anchor_feature) has no "
                       "published layout")
    if not m.qk_norm or m.qkv_bias != m.o_bias or m.mlp_bias:
      raise ValueError("the DFlash layout holds Qwen3 layers (q/k norms, attention_bias on all "
                       "of q, k, v, o or none, no MLP bias); this drafter's layers differ")
    model = m.to_hf_dict()
    for key in ("bos_token_id", "eos_token_id"):
      model.pop(key, None)
    dflash_config: dict[str, Any] = {"target_layer_ids": [int(h) - 1 for h in
                                                          drafter.hidden_layers]}
    if net.mask_token_id is not None:
      dflash_config["mask_token_id"] = int(net.mask_token_id)
    model.update(
        architectures=[ARCHITECTURE], model_type="qwen3", vocab_size=target_cfg.vocab_size,
        attention_bias=m.qkv_bias, tie_word_embeddings=False, block_size=net.block_size,
        num_target_layers=target_cfg.num_layers,
        layer_types=["full_attention"] * m.num_layers, dflash_config=dflash_config,
        torch_dtype=dtype or m.dtype)
    tensors = {published_name(k): common.torch_layout(k, v)
               for k, v in common.flat_params(drafter.params).items()}
    d2t = np.asarray(drafter.d2t)
    if not np.array_equal(d2t, np.arange(target_cfg.vocab_size)):
      tensors["d2t"] = common.offsets_from_d2t(d2t)
    common.write_weights(path, tensors, dtype)
    common.write_json(path, common.CONFIG, model)


formats.register(DFlashFormat())
