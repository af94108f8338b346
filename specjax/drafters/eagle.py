"""EAGLE (Li et al. 2024) with EAGLE-2's dynamic tree: one decoder layer at feature level.

The feature is the target's final normed hidden state (hidden index L), the input of its LM head.
At position i the drafter reads fc([e(x_{i+1}), f_i]) (2E -> E, with a bias by default), runs one
decoder layer (no input norm, as EAGLE's first layer) and outputs h_i, a prediction of f_{i+1}: the
target's own LM head (over the draft vocabulary, frozen) turns it into the draft distribution of
x_{i+2}, and h_i replaces f_{i+1} when drafting rolls forward. Training (specjax.train.drafter)
uses teacher forcing with EAGLE's two losses: cross-entropy against the target's distribution
and a smooth-L1 regression of h_i onto f_{i+1}.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config_utils import NonNegFloat, config
from specjax.drafters import eagle_common, io, learned
from specjax.models.config import ModelConfig


@config
class EagleConfig:
  """model: the draft layer's shapes (heads, head_dim, MLP width, RoPE, q/k/v bias, q/k norm):
  the target's config with num_layers = 1 when specjax trains the head, the published head's own
  for a loaded one (`specjax.drafters.eagle_format`); its hidden_size is the target's.
  fc_bias: whether fc carries a bias (EAGLE's default; its Llama-3 heads have none)."""

  model: ModelConfig
  fc_bias: bool = True

  @property
  def dtype(self) -> str:
    return self.model.dtype

  def with_dtype(self, dtype: str) -> EagleConfig:
    return dataclasses.replace(self, model=self.model.replace(dtype=dtype, compute_dtype=dtype))


@config
class EagleOptions(learned.FeatureNoiseOptions):
  """EAGLE's training options: feature noise and the weight of its feature regression."""

  regression_weight: NonNegFloat = 1.0  # weight of the feature regression (the auxiliary loss)

  @property
  def aux_weight(self) -> float:
    return self.regression_weight


class EagleNet(nnx.Module):

  def __init__(self, cfg: EagleConfig, rngs: nnx.Rngs):
    m = cfg.model
    e = m.hidden_size
    self.fc = nnx.Linear(2 * e, e, use_bias=cfg.fc_bias, dtype=m.jnp_dtype, param_dtype=m.jnp_dtype,
                         kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layer = eagle_common.DraftLayer(m, e, rngs)

  def features(self, f: jax.Array) -> jax.Array:
    return f

  def inputs(self, h: jax.Array, emb: jax.Array):
    x = self.fc(jnp.concatenate([emb, h], axis=-1))
    return x, x

  def head_input(self, h: jax.Array) -> jax.Array:
    """What the draft head reads: h itself (trained to be the target's final state)."""
    return h

  def logits(self, h: jax.Array, head: jax.Array) -> jax.Array:
    return jnp.einsum("...E,EV->...V", self.head_input(h), head,
                      preferred_element_type=jnp.float32)


class EagleFamily(eagle_common.EagleFamily):
  name = "eagle"
  description = "one feature-level decoder layer, EAGLE-2 dynamic tree (EAGLE-1/2)"
  module = EagleNet
  config_cls = EagleConfig
  options_cls = EagleOptions  # EAGLE-1's feature regression (its weight) and feature noise

  def make_config(self, target_cfg, *, draft_vocab_size, num_features, options=None
                  ) -> EagleConfig:
    del draft_vocab_size, num_features, options  # the target's head; one feature, the final state
    return EagleConfig(target_cfg.replace(num_layers=1, attention_impl="xla",
                                          compute_dtype=target_cfg.dtype))

  def depth_logits(self, net, params, x, num_steps, *, train=False):
    """logits[s] for the token at t + s + 2, unrolled on the drafter's own outputs; in
    training also EAGLE's feature regression of the step-0 output h_t onto the clean target
    feature f_{t+1} (smooth L1, averaged over positions and feature dimensions)."""
    network = learned.merge(EagleNet, net, params)
    logits, outs = eagle_common.unroll(network, x.feats, x.tokens, x.emb, x.head, num_steps)
    if not train:
      return logits, jnp.zeros((), jnp.float32)
    err = (outs[0][:, :-1] - x.clean[:, 1:]).astype(jnp.float32)
    smooth_l1 = jnp.where(jnp.abs(err) < 1.0, 0.5 * err**2, jnp.abs(err) - 0.5)
    return logits, smooth_l1.mean()


FAMILY = io.register_family(EagleFamily())
