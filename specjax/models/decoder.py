"""The decoder and its pure-functional entry points.

`Decoder` is a Flax NNX module used only through `nnx.split` / `nnx.merge`: the parameters live in
an `nnx.State` pytree and every entry point is a pure function of (config, params, inputs, cache).

One `forward` serves every use:
  * prefill:      cache at length 0, T = padded prompt, `new_mask` causal and key < prompt length;
  * decode step:  T = 1;
  * verification: T = tree size, `new_mask` the tree's ancestor-or-self relation, positions
                  `length + depth`;
  * training:     `cache=None`, causal mask, no cache allocated.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import sharding
from specjax.models import attention
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.layers import (
  DecoderLayer,
  RMSNorm,
  rope_inv_freq,
  rope_tables,
  scale_embeddings,
  softcap,
)


class ForwardOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] (or [B, I, V] when `logits_index` is given)
  hidden: jax.Array | None  # [len(hidden_layers), B, T, E] or None
  cache: KVCache | None


class Decoder(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.config = cfg
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_jnp_dtype,
                                  param_dtype=cfg.jnp_dtype,
                                  embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype, cfg.norm_offset)
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False,
                                dtype=cfg.compute_jnp_dtype, param_dtype=cfg.jnp_dtype,
                                kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

  def unembed(self, normed: jax.Array, kernel: jax.Array | None = None) -> jax.Array:
    """LM head on final-normed states, with Gemma's final soft-capping when set. `kernel`: the
    head's [E, V] weight to use instead of the model's own (`head_kernel`)."""
    if kernel is not None:
      normed, kernel = nnx.nn.dtypes.promote_dtype((normed, kernel),
                                                   dtype=self.config.compute_jnp_dtype)
      logits = jnp.dot(normed, kernel)
    elif self.config.tie_word_embeddings:
      logits = self.embed_tokens.attend(normed)
    else:
      logits = self.lm_head(normed)
    return softcap(logits, self.config.final_logit_softcapping)

  @jax.named_scope("lm_head")
  def head(self, x: jax.Array, kernel: jax.Array | None = None) -> jax.Array:
    """Final norm + LM head: [..., E] residual stream -> [..., V] logits."""
    return self.unembed(self.norm(x), kernel)

  def __call__(self, tokens, positions, new_mask, cache=None, hidden_layers=(), logits_index=None,
               num_layers=None, head_kernel=None):
    cfg = self.config
    num_layers = cfg.num_layers if num_layers is None else num_layers
    attn_fn = attention.get_attention_impl(cfg.attention_impl)
    tables = {}  # (theta, scaling) -> (cos, sin): one pair, or Gemma 3's local and global

    def rope(i):
      key = cfg.layer_rope(i)
      if key not in tables:
        tables[key] = rope_tables(positions, rope_inv_freq(cfg.head_dim, *key))
      return tables[key]

    with jax.named_scope("embed"):
      x = scale_embeddings(cfg, self.embed_tokens(tokens))
    hidden = {0: x}
    for i, layer in enumerate(self.layers[:num_layers]):
      x, cache = layer(x, *rope(i), new_mask, cache, i, attn_fn)
      hidden[i + 1] = x
    hidden[num_layers] = self.norm(x)  # HF convention: the last hidden state is normed
    if logits_index is not None:
      x = jnp.take_along_axis(x, logits_index[..., None], axis=1)
    logits = self.head(x, head_kernel)
    stacked = jnp.stack([hidden[i] for i in hidden_layers]) if hidden_layers else None
    return ForwardOutput(logits, stacked, cache)


@functools.cache
def graphdef(cfg: ModelConfig) -> nnx.GraphDef:
  """The static structure of a config's decoder (computed once, without allocating params)."""
  gdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
  return gdef


def abstract_params(cfg: ModelConfig) -> nnx.State:
  """ShapeDtypeStructs of the params: what a checkpoint must provide."""
  _, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
  return state


def init_params(cfg: ModelConfig, seed: int = 0) -> nnx.State:
  """Randomly initialised params (normal(0.02) weights, unit norms), as transformers does."""
  _, state = nnx.split(Decoder(cfg, nnx.Rngs(seed)))
  return state


def _check_hidden_layers(cfg: ModelConfig, hidden_layers: tuple[int, ...]):
  for i in hidden_layers:
    if not 0 <= i <= cfg.num_layers:
      raise ValueError(f"hidden layer index {i} out of range [0, {cfg.num_layers}] "
                       "(0 = embeddings, i = output of layer i, L = final normed state)")


def forward(cfg: ModelConfig, params: nnx.State, tokens: jax.Array, positions: jax.Array,
            new_mask: jax.Array, cache: KVCache | None = None, *,
            hidden_layers: tuple[int, ...] = (), logits_index: jax.Array | None = None,
            num_layers: int | None = None, head_kernel: jax.Array | None = None
            ) -> ForwardOutput:
  """Runs the decoder on T new tokens per row.

  tokens, positions: int32[B, T]; new_mask: bool[B, T, T] (query t may see new token j);
  cache: the KV cache whose slots `< length` are the committed prefix, or None for no prefix.
  hidden_layers: static indices of hidden states to return (0 = embeddings, i = output of layer
  i, L = after the final norm; the `output_hidden_states` convention of transformers).
  logits_index: optional int32[B, I]: compute logits only at these new-token positions.
  num_layers: run only the first m layers, then the final norm and LM head (layer-skip
  self-speculation); only those layers' cache entries are written.
  head_kernel: optional [E, V] weight for the LM head in place of the model's own, with the
  same values (`head_kernel`, made once outside a loop of forwards: `copies_head`).
  The returned cache has the new tokens written at `[length, length + T)`; `length` is unchanged.
  A sliding window (`cfg.sliding_window`) is not applied: the caller keeps every position below
  it (`ModelConfig.check_window`; `generate` and `full_forward` check).
  """
  _check_hidden_layers(cfg, hidden_layers)
  if num_layers is not None and not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
  model = nnx.merge(graphdef(cfg), params)
  return model(tokens, positions, new_mask, cache, tuple(hidden_layers), logits_index, num_layers,
               head_kernel)


def unembedding(cfg: ModelConfig, params: nnx.State) -> jax.Array:
  """[E, V] the LM head's weight (the input embedding transposed when tied)."""
  model = nnx.merge(graphdef(cfg), params)
  if cfg.tie_word_embeddings:
    return model.embed_tokens.embedding[...].T
  return model.lm_head.kernel[...]


def copies_head(cfg: ModelConfig, platform: str, rows: int) -> bool:
  """Whether forwards on `platform` with up to `rows` rows of logits each, in a loop, should
  read the LM head from a copy laid out [E, V] (`head_kernel`, made once outside the loop).

  Yes for a tied head on a CPU and blocks of several rows (a verification): the head multiplies
  by the embedding table transposed, and XLA's CPU dot repacks that [V, E] operand at every
  call, which costs a block of a few rows several times the product itself. One row reads the
  table as fast either way, so a one-token step keeps the model's own (the copy would only add
  its transposition); elsewhere (TPU, GPU) the dot reads either layout alike."""
  return cfg.tie_word_embeddings and platform == "cpu" and rows > 1


def head_kernel(cfg: ModelConfig, params: nnx.State) -> jax.Array:
  """The LM head's weight as `forward(head_kernel=)` takes it: [E, V] in the compute dtype, on a
  mesh split over the vocabulary as the table is. Its values are the model's own, so the logits
  are the same function of the weights (`copies_head` says when the copy pays)."""
  kernel = unembedding(cfg, params).astype(cfg.compute_jnp_dtype)
  return sharding.constrain(kernel, (None, "vocab"))


def lm_head(cfg: ModelConfig, params: nnx.State, normed: jax.Array) -> jax.Array:
  """Logits from final-normed hidden states (hidden index L): the unembedding alone."""
  return nnx.merge(graphdef(cfg), params).unembed(normed)


def causal_mask(lengths: jax.Array, t: int) -> jax.Array:
  """bool[B, T, T]: causal, and keys past each row's length hidden (a ragged, right-padded
  batch)."""
  idx = jnp.arange(t)
  causal = idx[None, :, None] >= idx[None, None, :]
  return causal & (idx[None, None, :] < lengths[:, None, None])


def full_forward(cfg: ModelConfig, params: nnx.State, tokens: jax.Array,
                 lengths: jax.Array | None = None, *, hidden_layers: tuple[int, ...] = ()
                 ) -> ForwardOutput:
  """Causal forward of a right-padded ragged batch without a cache (training, scoring)."""
  b, t = tokens.shape
  cfg.check_window(t, "the sequence length")
  lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return forward(cfg, params, tokens, positions, causal_mask(lengths, t), None,
                 hidden_layers=hidden_layers)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
  return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                      cfg.compute_jnp_dtype)


def num_params(params: nnx.State) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
