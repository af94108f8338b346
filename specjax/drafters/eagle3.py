"""EAGLE-3 (Li et al. 2025): fused low / middle / high target features, training-time test.

The hidden states of the target layers it taps (three by default, `hidden_layers`; training's
`target_layers` picks others; stored with the checkpoint) are concatenated and fused by `fc`
(nE -> E, no bias) into h. One decoder layer reads
[input_layernorm(e(x_{i+1})), hidden_norm(h)] (2E wide q/k/v projections) with h as the residual
stream; its output is both the next step's h and, through its own norm and LM head over the draft
vocabulary, the draft distribution. There is no feature regression: the layer is trained with the
training-time-test unroll (specjax.drafters.eagle_common.unroll), several steps on its own
outputs with per-step decaying weights, so drafting deep in a tree is what it was trained for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config_utils import PosInt, config
from specjax.drafters import eagle_common, io, learned
from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.models.layers import RMSNorm


@config
class Eagle3Config:
  model: ModelConfig  # the drafter layer's shapes: the target's config with num_layers = 1
  num_features: PosInt = 3  # target layers fused
  draft_vocab_size: PosInt = 2048

  @property
  def dtype(self) -> str:
    return self.model.dtype

  def with_dtype(self, dtype: str) -> Eagle3Config:
    return dataclasses.replace(self, model=self.model.replace(dtype=dtype, compute_dtype=dtype))


@config
class Eagle3Options(learned.FeatureNoiseOptions, learned.TapOptions):
  """EAGLE-3's training options: its taps, feature noise and the head ablation."""

  # Head ablation: keep the drafter's own draft head at its initial value (the target's).
  frozen_head: bool = False


class Eagle3Net(nnx.Module):

  def __init__(self, cfg: Eagle3Config, rngs: nnx.Rngs):
    m = cfg.model
    e, dtype = m.hidden_size, m.jnp_dtype
    self.fc = nnx.Linear(cfg.num_features * e, e, use_bias=False, dtype=dtype, param_dtype=dtype,
                         kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.input_layernorm = RMSNorm(e, m.rms_norm_eps, dtype)
    self.hidden_norm = RMSNorm(e, m.rms_norm_eps, dtype)
    self.layer = eagle_common.DraftLayer(m, 2 * e, rngs)
    self.norm = RMSNorm(e, m.rms_norm_eps, dtype)
    self.lm_head = nnx.Linear(e, cfg.draft_vocab_size, use_bias=False, dtype=dtype,
                              param_dtype=dtype, kernel_init=nnx.initializers.normal(0.02),
                              rngs=rngs)

  def features(self, f: jax.Array) -> jax.Array:
    return self.fc(f)

  def inputs(self, h: jax.Array, emb: jax.Array):
    return jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1), h

  def head_input(self, h: jax.Array) -> jax.Array:
    """What the draft head reads: h after the drafter's final norm (the target's, at init)."""
    return self.norm(h)

  def logits(self, h: jax.Array, head=None) -> jax.Array:
    return self.lm_head(self.head_input(h)).astype(jnp.float32)


class Eagle3Family(eagle_common.EagleFamily):
  name = "eagle3"
  description = "fused low/mid/high features, own draft head, training-time test (EAGLE-3)"
  module = Eagle3Net
  config_cls = Eagle3Config
  uses_target_head = False  # its own norm and LM head over the draft vocabulary
  options_cls = Eagle3Options

  def default_taps(self, target_cfg: ModelConfig) -> tuple[int, ...]:
    """Low, middle and high taps: outputs of layers L // 3 and 2L // 3, and the final state L.

    EAGLE-3 taps the inputs of layers 2, L // 2 and L - 3 of a deep target, where the last
    three layers are a small part of the network. On a shallow target the layer below the top
    would leave out a large part of it, so the high tap is the final (normed) state, the one the
    target's LM head reads.
    """
    n = target_cfg.num_layers
    return (max(1, n // 3), max(1, 2 * n // 3), n)

  def shrink_vocab(self, net, params, size):
    net, params = super().shrink_vocab(net, params, size)
    return net, learned.map_leaf(params, "lm_head/kernel", lambda k: k[:, :size])  # [E, Vd]

  def make_config(self, target_cfg, *, draft_vocab_size, num_features, options=None
                  ) -> Eagle3Config:
    del options  # its taps decide num_features; the rest are training's
    return Eagle3Config(target_cfg.replace(num_layers=1, attention_impl="xla",
                                           compute_dtype=target_cfg.dtype),
                        num_features, draft_vocab_size)

  def check_training(self, cfg) -> None:
    if cfg.train_steps < 3:
      raise ValueError(f"EAGLE-3's training-time test needs train_steps >= 3, got "
                       f"{cfg.train_steps}")

  def init_params(self, net, target, d2t, seed: int):
    """EAGLE-3's own head and final norm start as the target's (restricted to d2t)."""
    model = learned.merge(Eagle3Net, net, learned.init_params(Eagle3Net, net, seed))
    # Copies: the training state is donated, the target's buffers must survive it.
    model.lm_head.kernel[...] = jnp.copy(
        learned.restricted_head(target.config, target.params, d2t))
    model.norm.weight[...] = jnp.copy(nnx.merge(decoder.graphdef(target.config),
                                                target.params).norm.weight[...])
    return nnx.split(model)[1]

  def frozen_leaves(self, cfg):
    """Under `frozen_head`, the head (`norm`, `lm_head`) stays the target's: EAGLE's frozen head
    on EAGLE-3's layer."""
    if not cfg.family.frozen_head:
      return None
    return lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[0], "key", None) in ("norm", "lm_head"), params)

  def depth_logits(self, net, params, x, num_steps, *, train=False):
    """logits[s] for the token at t + s + 2 from the training-time-test unroll."""
    network = learned.merge(Eagle3Net, net, params)
    logits, _ = eagle_common.unroll(network, x.feats, x.tokens, x.emb, None, num_steps)
    return logits, jnp.zeros((), jnp.float32)


FAMILY = io.register_family(Eagle3Family())
