"""DFlash (Chen et al. 2026): a block of masked positions drafted in one non-causal pass.

The network is a stack of Qwen3-style decoder layers (pre-norm, per-head q/k RMSNorm, SwiGLU)
conditioned on the target: the hidden states of the target layers it taps (`hidden_layers`) are
concatenated and fused once, `ctx = hidden_norm(fc(concat))`, and every draft layer l attends to
that context as extra keys and values, `k_norm(k_proj_l(ctx))` and `v_proj_l(ctx)` (RoPE at the
context's own positions); the context itself never runs through the layers. The block is
`[last token, MASK x (B - 1)]` at positions a .. a + B - 1 (a: the anchor, the last emitted
token's position); it is embedded with the target's frozen embedding and attends non-causally to
itself and to the context *before* the anchor, whose features the target has computed. Position
k of the output predicts the token at a + k through the drafter's final norm and the target's
frozen LM head (restricted to the draft vocabulary, plus the history's recent tokens).

The anchor feature (`anchor_feature`, an option of this codebase): the fused context of the
position just before the anchor, the newest state the target has computed, also enters every
block position's input through `anchor_proj` (zero at initialisation), a direct path like the
feature EAGLE's input carries; the published layout reads the context through attention only.

The mask embedding. Published DFlash checkpoints reuse a spare row of the target's embedding
table (`mask_token_id`, e.g. Qwen3's 151669); a target whose vocabulary has no spare row (the
embedded target) gets the drafter's own trained vector `mask_embedding` [E] instead.

Drafting costs one forward of B tokens through the draft layers, whatever the tree's depth: the
per-depth marginals of that pass become a tree by `trees.tree_from_marginals` (the chain of
argmaxes, or DDTree's best-first tree under a node budget). The drafter's own KV cache holds the
context keys and values only (per layer, [n_layers, B, S, K, D]); a block's keys are never
stored, so there is nothing to roll back. `update` writes the context of the accepted path: the
target features of the block rows the round accepted (pending + accepted nodes).

Training (`DFlashFamily.depth_logits`) is the same forward over many blocks at once: for each
start t (anchor a = t + 1), the block at a sees the context at positions <= t and its own block.
Context attention (a per-block prefix mask over the row's S context keys) and intra-block
attention (B x B) are computed separately and merged by their log-sum-exps, so no dense
(N B) x (S + N B) mask is ever built; inference runs the same function with one block over its
cache. `num_anchors` trains on a random subset of starts per row (sorted, drawn without
replacement from the starts whose depth-1 target lies inside the row) instead of all of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax import checks, trees
from specjax.config_utils import Ge, NonNegInt, PosInt, config
from specjax.drafters import io, learned
from specjax.drafters.base import DraftContext, Prefill, RoundResult, TargetFacts, TargetView
from specjax.models import layers
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.layers import RMSNorm
from specjax.models.xla_attention import _MASK_VALUE


@config
class DFlashConfig:
  model: ModelConfig  # the draft layers' shapes: the target's config, num_layers = draft layers
  num_features: PosInt = 3  # target layers fused
  block_size: int = 8  # B: the last token and B - 1 masked positions (checked below)
  draft_vocab_size: PosInt = 2048
  mask_token_id: NonNegInt | None = None  # a target embedding row as the mask; None: own vector
  correction_rank: NonNegInt = 0  # the causal correction's width (0: none; `Correction`)
  anchor_feature: bool = False  # the context before the anchor into the block's inputs (above)

  def __post_init__(self):
    if not checks.is_int(self.block_size) or self.block_size < 2:
      raise ValueError(f"DFlash block_size must be an int >= 2 (the last token and at least "
                       f"one masked position), got {self.block_size!r}")
    if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.model.vocab_size:
      raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                       f"[0, {self.model.vocab_size})")
    if not checks.is_int(self.correction_rank) or self.correction_rank < 0:
      raise ValueError(f"correction_rank must be an int >= 0, got {self.correction_rank!r}")

  @property
  def dtype(self) -> str:
    return self.model.dtype

  @property
  def max_depth(self) -> int:
    """The deepest draft one block holds: B - 1 masked positions."""
    return self.block_size - 1

  def with_dtype(self, dtype: str) -> DFlashConfig:
    return dataclasses.replace(self, model=self.model.replace(dtype=dtype, compute_dtype=dtype))


@config
class DFlashOptions(learned.TapOptions):
  """DFlash's training options: its taps, the draft layers and block, and the anchors."""

  num_layers: PosInt = 1  # draft decoder layers
  num_kv_heads: NonNegInt = 0  # K/V heads of the draft layers (0: the target's)
  block_size: Annotated[int, Ge(2)] = 8  # B: the last token and B - 1 masked positions
  num_anchors: NonNegInt = 0  # the random starts (anchors) a step trains per row (0: all)
  correction_rank: NonNegInt = 0  # the causal correction's width (0: none)
  anchor_feature: bool = False  # the context before the anchor into the block's inputs


def block_attention(q, k, v, ctx_k, ctx_v, ctx_mask, sm_scale):
  """Non-causal block attention over a shared context, merged by log-sum-exp.

  q: [B, N, P, H, D] queries of N blocks of P positions; k, v: [B, N, P, K, D] the blocks' own
  keys and values (each block sees all of itself); ctx_k, ctx_v: [B, S, K, D] context keys and
  values; ctx_mask: bool[B, N, S], which context slots block n sees. Returns [B, N, P, H, D].
  """
  b, n, p, h, d = q.shape
  kv = k.shape[3]
  qg = q.reshape(b, n, p, kv, h // kv, d)

  def partial(scores, mask, values, spec):
    scores = jnp.where(mask, scores * sm_scale, _MASK_VALUE)
    top = jnp.max(scores, axis=-1, keepdims=True)
    w = jnp.exp(scores - top)
    total = jnp.sum(w, axis=-1, keepdims=True)
    out = jnp.einsum(spec, (w / total).astype(values.dtype), values,
                     preferred_element_type=jnp.float32)
    lse = jnp.where(jnp.any(mask, axis=-1, keepdims=True), top + jnp.log(total), -jnp.inf)
    return out, lse[..., 0]  # out [B, N, P, K, G, D], lse [B, N, K, G, P]

  s_ctx = jnp.einsum("BNPKGD,BSKD->BNKGPS", qg, ctx_k, preferred_element_type=jnp.float32)
  o_ctx, l_ctx = partial(s_ctx, ctx_mask[:, :, None, None, None, :], ctx_v,
                         "BNKGPS,BSKD->BNPKGD")
  s_blk = jnp.einsum("BNPKGD,BNQKD->BNKGPQ", qg, k, preferred_element_type=jnp.float32)
  o_blk, l_blk = partial(s_blk, jnp.ones((1, 1, 1, 1, 1, p), bool), v, "BNKGPQ,BNQKD->BNPKGD")
  lse = jnp.logaddexp(l_ctx, l_blk)  # the block part is never empty: lse is finite
  w_ctx = jnp.exp(l_ctx - lse).transpose(0, 1, 4, 2, 3)[..., None]  # [B, N, P, K, G, 1]
  w_blk = jnp.exp(l_blk - lse).transpose(0, 1, 4, 2, 3)[..., None]
  return (w_ctx * o_ctx + w_blk * o_blk).reshape(b, n, p, h, d).astype(q.dtype)


class DFlashLayer(nnx.Module):
  """A Qwen3 decoder layer whose attention also reads the fused context as keys and values."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    e, dtype = cfg.hidden_size, cfg.jnp_dtype
    self.input_layernorm = RMSNorm(e, cfg.rms_norm_eps, dtype)
    self.self_attn = layers.Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(e, cfg.rms_norm_eps, dtype)
    self.mlp = layers.MLP(cfg, rngs)

  @jax.named_scope("attention")
  def context_kv(self, ctx: jax.Array, cos, sin):
    """ctx [B, S, E] -> its keys (k_norm'd, RoPE'd) and values [B, S, K, D] for this layer."""
    attn = self.self_attn
    b, s, _ = ctx.shape
    _, kv, d = attn.shape
    k = attn.k_proj(ctx).reshape(b, s, kv, d)
    if attn.qk_norm:
      k = attn.k_norm(k)
    return layers.apply_rope(k, cos, sin), attn.v_proj(ctx).reshape(b, s, kv, d)

  def __call__(self, x, cos, sin, ctx_k, ctx_v, ctx_mask):
    """x: [B, N, P, E] blocks at RoPE tables (cos, sin) of [B, N * P] positions."""
    b, n, p, e = x.shape
    attn = self.self_attn
    with jax.named_scope("attention"):  # the sublayers' scopes, as in the target's layers
      q, k, v = attn.project(self.input_layernorm(x).reshape(b, n * p, e), cos, sin)
      split = lambda a: a.reshape((b, n, p) + a.shape[2:])  # noqa: E731
      out = block_attention(split(q), split(k), split(v), ctx_k, ctx_v, ctx_mask, attn.sm_scale)
      x = x + attn.output(out.reshape((b, n * p) + out.shape[3:])).reshape(b, n, p, e)
    with jax.named_scope("mlp"):
      return x + self.mlp(self.post_attention_layernorm(x))


class Correction(nnx.Module):
  """The causal correction: h'_k = h_k + up(silu(down([h_k, e(x_{k-1})]))), a rank-r residual
  that conditions block position k on the token drafted at k - 1 (the block's first token for
  k = 1), in the spirit of TreeFlash and Domino. `up` starts at zero: an untrained correction
  is the identity. Inference applies it depth by depth, so a tree's siblings no longer share
  one marginal; it costs one small matmul and one head per depth."""

  def __init__(self, e: int, rank: int, eps: float, dtype, rngs: nnx.Rngs):
    self.norm = RMSNorm(e, eps, dtype)
    self.down = nnx.Linear(2 * e, rank, use_bias=False, dtype=dtype, param_dtype=dtype,
                           kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.up = nnx.Linear(rank, e, use_bias=False, dtype=dtype, param_dtype=dtype,
                         kernel_init=nnx.initializers.zeros, rngs=rngs)

  @jax.named_scope("correction")
  def codes(self, h: jax.Array, prev_emb: jax.Array) -> jax.Array:
    """[..., rank]: silu(down([h, e(x_{k-1})])), what `up` maps into the residual."""
    z = jnp.concatenate([h, self.norm(prev_emb.astype(h.dtype))], axis=-1)
    return jax.nn.silu(self.down(z))

  def __call__(self, h: jax.Array, prev_emb: jax.Array) -> jax.Array:
    """h: [..., E] block outputs; prev_emb: [..., E] embeddings of the tokens above them."""
    with jax.named_scope("correction"):
      return h + self.up(self.codes(h, prev_emb))


class DFlashNet(nnx.Module):

  def __init__(self, cfg: DFlashConfig, rngs: nnx.Rngs):
    m = cfg.model
    e, dtype = m.hidden_size, m.jnp_dtype
    self.fc = nnx.Linear(cfg.num_features * e, e, use_bias=False, dtype=dtype, param_dtype=dtype,
                         kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.hidden_norm = RMSNorm(e, m.rms_norm_eps, dtype)
    self.layers = nnx.List([DFlashLayer(m, rngs) for _ in range(m.num_layers)])
    self.norm = RMSNorm(e, m.rms_norm_eps, dtype)
    if cfg.mask_token_id is None:
      self.mask_embedding = nnx.Param(
          nnx.initializers.normal(0.02)(rngs.params(), (e,), dtype))
    if cfg.correction_rank:
      self.correction = Correction(e, cfg.correction_rank, m.rms_norm_eps, dtype, rngs)
    if cfg.anchor_feature:  # zero at the start: an untrained anchor path changes nothing
      self.anchor_proj = nnx.Linear(e, e, use_bias=False, dtype=dtype, param_dtype=dtype,
                                    kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.rope = (m.head_dim, m.rope_theta, m.rope_scaling)  # static; tables at trace time

  def tables(self, positions: jax.Array):
    return layers.rope_tables(positions, layers.rope_inv_freq(*self.rope))

  def context(self, feats: jax.Array) -> jax.Array:
    """feats [B, S, F] target features of the taps -> the fused context [B, S, E]."""
    return self.hidden_norm(self.fc(feats))

  def context_kv(self, ctx: jax.Array, positions: jax.Array):
    """ctx [B, S, E] fused context at int32[B, S] positions -> per layer (k, v)."""
    cos, sin = self.tables(positions)
    return [layer.context_kv(ctx, cos, sin) for layer in self.layers]

  def embed_blocks(self, first: jax.Array, mask_row: jax.Array, size: int,
                   anchor_ctx: jax.Array | None = None) -> jax.Array:
    """first [B, N, E] embeddings of the blocks' first tokens -> [B, N, size, E]; the masked
    positions get `mask_row` [E] (the target's mask row, or the own `mask_embedding`). With the
    anchor feature, `anchor_ctx` [B, N, E] (each block's context before its anchor) enters
    every position through `anchor_proj`."""
    rest = jnp.broadcast_to(mask_row.astype(first.dtype), first.shape[:2] + (size - 1,)
                            + first.shape[2:])
    x = jnp.concatenate([first[:, :, None], rest], axis=2)
    if anchor_ctx is None:
      return x
    return x + self.anchor_proj(anchor_ctx.astype(x.dtype))[:, :, None]

  def mask_row(self, emb_table: jax.Array, mask_token_id: int | None) -> jax.Array:
    return self.mask_embedding[...] if mask_token_id is None else emb_table[mask_token_id]

  def __call__(self, x, positions, ctx_kv, ctx_mask):
    """x: [B, N, P, E] block embeddings at int32[B, N, P] positions -> [B, N, P, E] normed
    outputs (the target head's input)."""
    b, n, p, _ = x.shape
    cos, sin = self.tables(positions.reshape(b, n * p))
    for layer, (k, v) in zip(self.layers, ctx_kv):
      x = layer(x, cos, sin, k, v, ctx_mask)
    return self.norm(x)


def check_block_options(depth: int, top_k: int, total_tokens: int, block_size: int, vocab: int
                        ) -> tuple[int, int, int]:
  """Tree options (ints) that fit a block of `block_size` over a `vocab`-token draft vocabulary."""
  depth = checks.integer("depth", depth)
  top_k = checks.integer("top_k", top_k)
  total_tokens = checks.integer("total_tokens", total_tokens)
  if not 1 <= depth <= block_size - 1:
    raise ValueError(f"depth {depth} does not fit the drafter's block: a block of "
                     f"{block_size} drafts depths 1..{block_size - 1}")
  if not 1 <= top_k <= vocab:
    raise ValueError(f"top_k must be in [1, {vocab}] (the draft vocabulary), got {top_k}")
  most = trees.grown_tree_capacity(depth, top_k)
  if not 1 <= total_tokens <= most:
    raise ValueError(f"total_tokens must be in [1, {most}] for depth {depth} and top_k {top_k} "
                     f"(a block of {block_size}), got {total_tokens}")
  return depth, top_k, total_tokens


@struct.dataclass
class DFlashState:
  cache: KVCache  # [n_layers, B, S_d, K, D] context keys/values; length = hist_len - 1
  last: jax.Array | None = None  # [B, E] the fused context at slot length - 1 (anchor feature)
  # [rank, Vd] the draft head applied to the correction's `up` rows (`DFlashDrafter.draft`):
  # computed once per call, since the head and the correction are fixed while it decodes.
  lifted_up: jax.Array | None = None


@struct.dataclass
class DFlashDrafter(learned.LearnedDrafter):
  """One block forward per round, its marginals made a tree (chain: top_k 1, depth nodes)."""

  # Required (by keyword: the base's fields with defaults come first): the network's config;
  # `_network()` merges it with the params into the DFlashNet that runs (`network`).
  net: DFlashConfig = struct.field(pytree_node=False, kw_only=True)
  depth: int = struct.field(pytree_node=False, default=7)
  top_k: int = struct.field(pytree_node=False, default=1)
  total_tokens: int = struct.field(pytree_node=False, default=7)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())

  @property
  def num_nodes(self) -> int:
    return self.total_tokens

  @property
  def counts_fixed(self) -> bool:
    """Whether its sampled trees fix each node's number of children before drawing them
    (`verify.Rule('kseq')` needs it): always for the marginals' tree, which reads no token;
    for the corrected block's grown tree, `trees.grown_counts_fixed`."""
    return not self.net.correction_rank or trees.grown_counts_fixed(
        self.depth, self.top_k, self.total_tokens)

  @property
  def partition_config(self):
    """The draft layers' own shapes decide how their heads split (`specjax.sharding`)."""
    return self.net.model

  @property
  def _longest_path(self) -> int:
    return min(self.depth, self.total_tokens)

  def _network(self) -> DFlashNet:
    return learned.merge(DFlashNet, self.net, self.params)

  def _write_context(self, network: DFlashNet, cache: KVCache, feats, positions
                     ) -> tuple[KVCache, jax.Array]:
    """Writes the context keys/values of feats [B, T, F] at slots [length, length + T);
    returns the cache and the fused context [B, T, E]."""
    ctx = network.context(feats.astype(self.head_dtype))
    for i, (k, v) in enumerate(network.context_kv(ctx, positions)):
      cache = cache.write(i, k, v)
    return cache, ctx

  def _last(self, ctx: jax.Array, index: jax.Array) -> jax.Array | None:
    """ctx[b, index[b]] [B, E] when the network reads the anchor feature, else None."""
    if not self.net.anchor_feature:
      return None
    return jnp.take_along_axis(ctx, index[:, None, None], axis=1)[:, 0]

  def init(self, target: TargetView, prefill: Prefill) -> DFlashState:
    m = self.net.model
    b, p = prefill.prompt.shape
    slots = prefill.history.shape[1] + self._longest_path + 1
    cache = KVCache.init(m.num_layers, b, slots, m.num_kv_heads, m.head_dim, self.head_dtype)
    feats = learned.concat_features(prefill.hidden)  # [B, P, F]: the whole prompt is context
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    network = self._network()
    cache, ctx = self._write_context(network, cache, feats, positions)
    length = prefill.hist_len - 1
    lifted = None if not self.net.correction_rank else jnp.einsum(
        "RE,EV->RV", network.correction.up.kernel[...], self.head,
        preferred_element_type=jnp.float32)
    return DFlashState(cache.replace(length=length), self._last(ctx, length - 1), lifted)

  def _block(self, network: DFlashNet, target: TargetView, state: DFlashState, ctx: DraftContext):
    """[B, depth, E] the block's outputs at depths 1..depth (the head's input)."""
    cfg = target.config
    size = self.net.block_size
    cache = state.cache
    start = ctx.hist_len - 1  # the pending token's position: the anchor
    first = learned.embed(cfg, target.params, ctx.pending).astype(self.head_dtype)[:, None]
    mask_id = self.net.mask_token_id  # `mask_row`, gathering the one row rather than the table
    mask = network.mask_embedding[...] if mask_id is None else learned.embed(
        cfg, target.params, jnp.asarray(mask_id))
    last = None if state.last is None else state.last[:, None]
    x = network.embed_blocks(first, mask, size, last)
    positions = (start[:, None] + jnp.arange(size)[None, :]).astype(jnp.int32)[:, None]
    ctx_mask = (jnp.arange(cache.max_len)[None, :] < cache.length[:, None])[:, None]
    ctx_kv = [(cache.k[i], cache.v[i]) for i in range(self.net.model.num_layers)]
    return network(x, positions, ctx_kv, ctx_mask)[:, 0, 1:self.depth + 1]

  @jax.named_scope("lm_head")
  def _head(self, h: jax.Array, recent: learned.RecentVocab | None) -> jax.Array:
    logits = jnp.einsum("B...E,EV->B...V", h, self.head, preferred_element_type=jnp.float32)
    return learned.with_recent(logits, h, recent)

  def block_logits(self, target: TargetView, state: DFlashState, ctx: DraftContext,
                   prev: jax.Array | None = None):
    """(float32[B, depth, Vd (+ recent)] draft logits of depths 1..depth, the round's recent
    ids). Without a correction these are the block's marginals; with one, depth d is
    conditioned on prev[:, d - 1] (int32[B, depth] target ids; prev[:, 0] is `pending`)."""
    network = self._network()
    h = self._block(network, target, state, ctx)
    if self.net.correction_rank:
      if prev is None:
        raise ValueError("a corrected DFlash's depth d reads the token at d - 1: pass prev")
      h = network.correction(h, learned.embed(target.config, target.params, prev))
    recent = self.recent_vocab(target, ctx)
    return self._head(h, recent), recent

  def _corrected(self, network: DFlashNet, target: TargetView, state: DFlashState, h: jax.Array,
                 recent: learned.RecentVocab | None):
    """`corrected(level, tokens)`: float32[B, k, Vd (+ R)] draft log-probabilities at depth
    level + 1 conditioned on tokens int32[B, k] (target ids) above it, from the block's
    outputs h [B, depth, E].

    The head is linear and reads the corrected state directly, so the logits are
    head(h_d) + codes_d @ head(up): every depth's uncorrected logits in one pass, then per depth
    a rank-r product with the head lifted through `up` (the fixed vocabulary's part kept in the
    state, the round's recent ids' here) instead of the whole head once more."""
    cfg = target.config
    base = self._head(h, recent)  # [B, depth, Vd (+ R)]
    lifted_recent = None if recent is None else jnp.einsum(
        "RE,BNE->BRN", network.correction.up.kernel[...], recent.cols,
        preferred_element_type=jnp.float32)

    def corrected(level, tokens):
      hk = jnp.broadcast_to(h[:, level, None], tokens.shape + h.shape[-1:])
      codes = network.correction.codes(hk, learned.embed(cfg, target.params, tokens))
      with jax.named_scope("lm_head"):
        delta = jnp.einsum("BKR,RV->BKV", codes, state.lifted_up,
                           preferred_element_type=jnp.float32)
        if lifted_recent is not None:
          delta = jnp.concatenate([delta, jnp.einsum(
              "BKR,BRN->BKN", codes, lifted_recent, preferred_element_type=jnp.float32)], -1)
      return learned.draft_logprobs(base[:, level, None] + delta)

    return corrected

  def draft(self, target: TargetView, state: DFlashState, ctx: DraftContext):
    network = self._network()
    h = self._block(network, target, state, ctx)
    recent = self.recent_vocab(target, ctx)
    if not self.net.correction_rank:  # one marginal per depth: DDTree's best-first tree
      grown = trees.tree_from_marginals(learned.draft_logprobs(self._head(h, recent)),
                                        num_nodes=self.total_tokens, top_k=self.top_k,
                                        children=self.children, sampling=target.sampling,
                                        key=ctx.rng)
    else:  # each frontier node's children conditioned on its own token
      corrected = self._corrected(network, target, state, h, recent)

      def expand(carry, tokens, parent, level):
        return corrected(level, self.to_target_ids(tokens, recent)), carry

      root = corrected(0, ctx.pending[:, None])[:, 0]
      grown, _ = trees.grow_dynamic_tree(root, expand, (), depth=self.depth, top_k=self.top_k,
                                         num_nodes=self.total_tokens, children=self.children,
                                         sampling=target.sampling, key=ctx.rng)
    tree = self.with_targets(grown.tree, recent)
    return tree, state, ctx.cache

  def update(self, target: TargetView, state: DFlashState, result: RoundResult) -> DFlashState:
    acc = result.acceptance
    rows = self._longest_path + 1  # pending + the accepted nodes fit in the path's first rows
    feats = learned.concat_features(result.hidden)  # [B, N+1, F]
    feats = jnp.take_along_axis(feats, acc.path[:, :rows, None], axis=1)
    c = state.cache.length
    positions = (c[:, None] + jnp.arange(rows)[None, :]).astype(jnp.int32)
    cache, ctx = self._write_context(self._network(), state.cache, feats, positions)
    last = self._last(ctx, acc.n_accepted)  # the last accepted row: the next anchor's previous
    if last is not None:
      last = jnp.where(result.live[:, None], last, state.last)
    return state.replace(cache=cache.replace(length=jnp.where(result.live, c + acc.n_accepted + 1,
                                                             c)), last=last)


def sample_starts(key: jax.Array, batch: int, length: int, num: int) -> jax.Array:
  """int32[batch, num]: per row, `num` distinct starts t in [0, length - 2] (the depth-1 target
  t + 2 ... lies inside the row from t <= length - 2), uniformly without replacement, sorted."""
  if not 1 <= num <= length - 1:
    raise ValueError(f"num_anchors must be in [1, {length - 1}] for rows of {length} tokens, "
                     f"got {num}")
  u = jax.random.uniform(key, (batch, length - 1))
  return jnp.sort(jnp.argsort(u, axis=1)[:, :num], axis=1).astype(jnp.int32)


def training_logits(network: DFlashNet, net: DFlashConfig, feats, tokens, emb_table, head, starts,
                    num_steps: int):
  """float32[num_steps, B, N, Vd]: logits[s, b, n] for the token at starts[b, n] + s + 2.

  The block of start t is anchored at a = t + 1 (its first token tokens[a], RoPE positions
  a .. a + B - 1) and sees the context at positions <= t: exactly what `DFlashDrafter` computes
  at a round whose pending token sits at a. Anchors past the row's end read its last token
  (their targets lie past the end too and are never scored)."""
  b, t = tokens.shape
  size = net.block_size
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  ctx = network.context(feats)
  ctx_kv = network.context_kv(ctx, positions)
  anchor = jnp.minimum(starts + 1, t - 1)
  first = jnp.take(emb_table, jnp.take_along_axis(tokens, anchor, axis=1), axis=0)
  anchor_ctx = (jnp.take_along_axis(ctx, starts[:, :, None], axis=1)  # position t = a - 1
                if net.anchor_feature else None)
  x = network.embed_blocks(first.astype(feats.dtype),
                           network.mask_row(emb_table, net.mask_token_id), size, anchor_ctx)
  block_pos = (starts + 1)[:, :, None] + jnp.arange(size)[None, None, :]
  ctx_mask = jnp.arange(t)[None, None, :] <= starts[:, :, None]  # strict: before the anchor
  h = network(x, block_pos.astype(jnp.int32), ctx_kv, ctx_mask)[:, :, 1:num_steps + 1]
  if net.correction_rank:  # depth k reads the true token at k - 1 (teacher forcing)
    above = jnp.minimum(starts[:, :, None] + 1 + jnp.arange(num_steps)[None, None, :], t - 1)
    prev = jnp.take_along_axis(tokens, above.reshape(b, -1), axis=1).reshape(above.shape)
    h = network.correction(h, jnp.take(emb_table, prev, axis=0))
  logits = jnp.einsum("BNPE,EV->PBNV", h, head, preferred_element_type=jnp.float32)
  return logits


class DFlashFamily(learned.Family):
  name = "dflash"
  description = "block-parallel drafter: B masked positions in one non-causal pass (DFlash)"
  module = DFlashNet
  config_cls = DFlashConfig
  uses_target_head = True
  options_cls = DFlashOptions
  # One mask embedding serves every masked position and positions are RoPE'd: no parameter
  # depends on the block size, so a trained drafter can start a run with a longer block.
  free_fields = ("block_size",)

  def default_taps(self, target_cfg: ModelConfig) -> tuple[int, ...]:
    """Low, middle and high taps spread over the target (outputs of layers L // 3, 2L // 3 and
    the final state L), as for EAGLE-3: a shallow target has few layers to spread over."""
    n = target_cfg.num_layers
    return tuple(sorted({max(1, n // 3), max(1, 2 * n // 3), n}))

  def make_config(self, target_cfg, *, draft_vocab_size, num_features,
                  options: DFlashOptions | None = None, mask_token_id: int | None = None
                  ) -> DFlashConfig:
    """Draft layers shaped as the target's (`num_kv_heads` 0), or with more K/V heads: every
    masked position reads the context and the last token only through its layers' values, so
    a target with few K/V heads narrows what one layer can carry."""
    o = options or DFlashOptions()
    heads = target_cfg.num_heads
    num_kv_heads = o.num_kv_heads or target_cfg.num_kv_heads
    if heads % num_kv_heads:
      raise ValueError(f"num_kv_heads must divide the {heads} attention heads, got {num_kv_heads}")
    model = target_cfg.replace(num_layers=o.num_layers, num_kv_heads=num_kv_heads,
                               attention_impl="xla", qk_norm=True, compute_dtype=target_cfg.dtype)
    return DFlashConfig(model, num_features, o.block_size, draft_vocab_size, mask_token_id,
                        o.correction_rank, o.anchor_feature)

  def check_training(self, cfg) -> None:
    o, steps = cfg.family, max(cfg.train_steps, cfg.eval_depth)
    if steps > o.block_size - 1:
      raise ValueError(f"train_steps and eval_depth must be at most block_size - 1 = "
                       f"{o.block_size - 1} (the depths one block drafts), got {steps}")
    if o.num_anchors and not 1 <= o.num_anchors <= cfg.row_len - 1:
      raise ValueError(f"num_anchors must be in [1, {cfg.row_len - 1}] for rows of "
                       f"{cfg.row_len} tokens, got {o.num_anchors}")

  def starts(self, cfg, key, batch: int, length: int):
    """A random subset of `num_anchors` starts per row (None: every start)."""
    num = cfg.family.num_anchors
    if not num:
      return None
    if key is None:
      raise ValueError("random anchors (num_anchors) are drawn from the step's key: the batch "
                       "needs one ('key')")
    return sample_starts(key, batch, length, num)

  def depth_logits(self, net, params, x, num_steps, *, train=False):
    """logits[s, b, n] for the token at starts[b, n] + s + 2: block position s + 1 of the block
    anchored after start n (every start when `x.starts` is None)."""
    if num_steps > net.block_size - 1:
      raise ValueError(f"a block of {net.block_size} drafts depths 1..{net.block_size - 1}, "
                       f"asked for {num_steps}")
    b, t = x.tokens.shape
    starts = x.starts if x.starts is not None else jnp.broadcast_to(
        jnp.arange(t, dtype=jnp.int32), (b, t))
    network = learned.merge(DFlashNet, net, params)
    return training_logits(network, net, x.feats, x.tokens, x.emb, x.head, starts,
                           num_steps), jnp.zeros((), jnp.float32)

  def assemble(self, net, params, d2t, target, hidden_layers, *, depth: int | None = None,
               top_k: int = 1, total_tokens: int | None = None, recent_tokens: int = 0,
               children=learned.DEFAULT_CHILDREN, draft_temperature=None) -> DFlashDrafter:
    """Tree options: `depth` (<= block_size - 1; default the whole block), `top_k` (the
    frontier kept per depth; 1 with total_tokens = depth is the chain) and `total_tokens` (the
    node budget; default depth), plus `recent_tokens` (`LearnedDrafter.recent_vocab`),
    `children` and `draft_temperature` (`specjax.children`: sampled children of every
    expanded node, drawn from its depth's marginal)."""
    depth = net.max_depth if depth is None else depth
    total_tokens = depth if total_tokens is None else total_tokens
    depth, top_k, total_tokens = check_block_options(depth, top_k, total_tokens,
                                                     net.block_size, d2t.shape[0])
    if len(hidden_layers) != net.num_features:
      raise ValueError(f"the DFlash network fuses {net.num_features} target layers, "
                       f"hidden_layers has {len(hidden_layers)}")
    recent_tokens = learned.check_recent_tokens(recent_tokens, target.config)
    head = learned.restricted_head(target.config, target.params, d2t).astype(net.dtype)
    return DFlashDrafter(params=params, d2t=d2t, head=head, recent_tokens=recent_tokens,
                         built_for=TargetFacts.of(target.config),
                         children=learned.check_children(children, draft_temperature),
                         net=net, depth=depth,
                         top_k=top_k, total_tokens=total_tokens, hidden_layers=hidden_layers)

  def tree_options(self, spec: str) -> dict:
    """'d': a chain of d nodes; 'd x k x n' (e.g. '7x8x24'): depth d, top_k k, n nodes (the
    best-first tree under a budget of n)."""
    return learned.grown_tree_options(spec, self.name, "7x8x24")

  def tune_grid(self) -> list[dict]:
    """Chains of 3, 5 and the whole block's depth, then best-first trees of growing node
    budgets over the whole block (depth None: block_size - 1)."""
    chains = [dict(depth=d, top_k=1, total_tokens=d) for d in (3, 5)] + [dict(top_k=1)]
    grown = [dict(top_k=k, total_tokens=n) for k, n in ((2, 10), (4, 16), (8, 24), (16, 32))]
    return chains + grown


def gamma_decay(gamma: float) -> float:
  """The per-depth weight ratio of DFlash's position-decayed loss, w_k = exp(-(k - 1) / gamma):
  the trainer's `step_decay`."""
  return math.exp(-1.0 / gamma)


FAMILY = io.register_family(DFlashFamily())
