"""The feature-level autoregressive drafter shared by EAGLE (1/2) and EAGLE-3.

Both families run one decoder layer over pairs (feature of position i, embedding of token i + 1)
at RoPE position i; its output h_i stands for the feature of position i + 1 and gives the draft
distribution of token i + 2. Drafting rolls forward on the drafter's own outputs. A family's
network module supplies four pieces (see `eagle.py`, `eagle3.py`):

  features(target_feats) -> h         what the target's features become (identity / fused fc)
  inputs(h, emb) -> (attn_in, resid)  the layer's attention input and residual stream
  layer: DraftLayer                   q/k/v/o projections over attn_in, SwiGLU MLP
  logits(h_out, head) -> [.., Vd]     the draft head (the target's restricted head / its own)
  head_input(h_out) -> [.., E]        what that head reads (h / h after the drafter's norm)

Inference (`EagleDrafter`, one jitted round). The drafter keeps its own one-layer KV cache whose
committed length c is hist_len - 2 at the start of a round: slots < c hold pairs whose feature is
a *target* feature. `update` stores the target features of the block rows on the accepted path
(pending + accepted nodes); the next `draft` feeds those n_accepted + 1 pairs (row j: feature of
position c + j, token history[c + j + 1]), which makes c = hist_len - 1; its last output drafts
the root's children. EAGLE-2's dynamic tree (`trees.grow_dynamic_tree`) then feeds each frontier
of top_k nodes at one position per level; their keys go to tree slots after c, where each node
sees the committed prefix and its ancestors-or-self (its own row of the ancestor mask). Tree slots
are never committed: the next round overwrites them.

Training (`unroll`) is EAGLE-3's training-time test: step 0 runs the pairs with target features
(teacher forcing, causal attention); step s feeds, at index t, the step s - 1 output with token
t + s + 1 at position t + s, attending to the step-0 keys at indices <= t and to its own keys of
steps 1..s at index t -- exactly what the depth-(s + 1) node of a tree rooted after position t
sees at inference. EAGLE (1/2) trains step 0 only (plus its feature regression); evaluation
unrolls both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax import checks, trees
from specjax.drafters import learned
from specjax.drafters.base import DraftContext, Prefill, RoundResult, TargetFacts, TargetView
from specjax.models import attention, decoder, layers
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.xla_attention import _MASK_VALUE


class DraftLayer(layers.Attention):
  """One decoder layer without its input norm: the target architecture's attention (q/k/v over
  an `attn_in`-wide input, EAGLE-3: 2E), then the post-attention norm and the SwiGLU MLP.

  It is the attention module itself plus the MLP block, so its parameters keep the flat layout
  of drafter folders (`q_proj`, ..., `post_attention_layernorm`, `mlp`). The layer runs in two
  halves around the attention, which the drafter computes itself (its own cache, or the
  training-time-test pattern): `qkv`, then `finish`.
  """

  def __init__(self, cfg: ModelConfig, attn_in: int, rngs: nnx.Rngs):
    super().__init__(cfg, rngs, in_features=attn_in)
    self.post_attention_layernorm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                   cfg.jnp_dtype)
    self.mlp = layers.MLP(cfg, rngs)
    self.rope = (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # static; tables at trace time

  @jax.named_scope("attention")
  def qkv(self, x: jax.Array, positions: jax.Array):
    """x: [B, T, attn_in], positions int32[B, T] -> q [B, T, H, D], k, v [B, T, K, D]."""
    cos, sin = layers.rope_tables(positions, layers.rope_inv_freq(*self.rope))
    return self.project(x, cos, sin)

  def finish(self, residual: jax.Array, attn_out: jax.Array) -> jax.Array:
    with jax.named_scope("attention"):
      x = residual + self.output(attn_out)
    with jax.named_scope("mlp"):
      return x + self.mlp(self.post_attention_layernorm(x))


# ------------------------------------------------------------------------------------------------
# Training: the training-time-test unroll


def _ttt_attention(q, keys, values, sm_scale):
  """q [B, T, H, D] of step s; keys/values: per step 0..s [B, T, K, D]. Index t sees step-0 keys
  at indices <= t and the keys of steps 1..s at index t (its own chain)."""
  b, t, h, d = q.shape
  kv = keys[0].shape[2]
  qg = q.reshape(b, t, kv, h // kv, d)
  causal = jnp.tril(jnp.ones((t, t), bool))
  s0 = jnp.einsum("BTKGD,BSKD->BKGTS", qg, keys[0], preferred_element_type=jnp.float32)
  s0 = jnp.where(causal, s0 * sm_scale, _MASK_VALUE)
  diag = [jnp.einsum("BTKGD,BTKD->BKGT", qg, k, preferred_element_type=jnp.float32)[..., None]
          * sm_scale for k in keys[1:]]
  probs = jax.nn.softmax(jnp.concatenate([s0, *diag], axis=-1), axis=-1)
  out = jnp.einsum("BKGTS,BSKD->BTKGD", probs[..., :t].astype(values[0].dtype), values[0],
                   preferred_element_type=jnp.float32)
  for j, v in enumerate(values[1:]):
    out = out + probs[..., t + j].transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None]
  return out.reshape(b, t, h, d).astype(q.dtype)


def unroll(network, feats: jax.Array, tokens: jax.Array, emb_table: jax.Array, head,
           num_steps: int):
  """logits[s, b, t] (draft vocabulary) for the token at t + s + 2, and the step outputs h[s].

  feats: [B, T, F] target features; tokens: int32[B, T]. Token t + s + 1 past the row's end is
  replaced by token 0 (its logits are never scored: their targets are past the end too).
  """
  b, t = tokens.shape
  h = network.features(feats)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  keys, values, logits, outs = [], [], [], []
  for s in range(num_steps):
    nxt = jnp.pad(tokens[:, s + 1:], ((0, 0), (0, s + 1)))
    attn_in, resid = network.inputs(h, jnp.take(emb_table, nxt, axis=0).astype(h.dtype))
    q, k, v = network.layer.qkv(attn_in, positions + s)
    keys.append(k)
    values.append(v)
    h = network.layer.finish(resid, _ttt_attention(q, keys, values, network.layer.sm_scale))
    outs.append(h)
    logits.append(network.logits(h, head))
  return jnp.stack(logits), jnp.stack(outs)


# ------------------------------------------------------------------------------------------------
# Inference


@struct.dataclass
class EagleState:
  cache: KVCache  # [1, B, S_d, K, D] the drafter's own; length = c
  feats: jax.Array  # [B, P + 1, F] target features of the pairs not yet fed (P: longest path)
  n_new: jax.Array  # int32[B] how many of them (>= 1)


@struct.dataclass
class EagleDrafter(learned.LearnedDrafter):
  """EAGLE-2 dynamic-tree drafting with a family's network.

  Required (by keyword: the base's fields with defaults come first): `module`, the family's
  nnx.Module class, and `net`, its config (hashable, static). `_network()` merges them with the
  params into the module instance that runs, named `network` wherever it is passed."""

  module: type = struct.field(pytree_node=False, kw_only=True)
  net: object = struct.field(pytree_node=False, kw_only=True)
  depth: int = struct.field(pytree_node=False, default=6)
  top_k: int = struct.field(pytree_node=False, default=4)
  total_tokens: int = struct.field(pytree_node=False, default=16)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())

  @property
  def num_nodes(self) -> int:
    return self.total_tokens

  @property
  def counts_fixed(self) -> bool:
    """Whether its sampled trees fix each node's number of children before drawing them
    (`trees.grown_counts_fixed`; what `verify.Rule('kseq')` needs)."""
    return trees.grown_counts_fixed(self.depth, self.top_k, self.total_tokens)

  @property
  def partition_config(self):
    """The draft layer's own shapes decide how its heads split (`specjax.sharding`)."""
    return self.net.model

  @property
  def _tree_slots(self) -> int:
    return (self.depth - 1) * self.top_k

  @property
  def _longest_path(self) -> int:
    """The most draft nodes one round can accept: the tree's depth, or its size if smaller."""
    return min(self.depth, self.total_tokens)

  def _network(self):
    return learned.merge(self.module, self.net, self.params)

  def _feed(self, network, h, emb, positions, cache: KVCache, write_at, mask):
    """Runs the layer on [B, T] pairs, writing their K/V at `write_at`; mask: bool[B, T, S_d]."""
    attn_in, resid = network.inputs(h, emb)
    q, k, v = network.layer.qkv(attn_in, positions)
    with jax.named_scope("attention"):
      cache = cache.replace(length=write_at).write(0, k, v)
      out = attention.xla_attention(q, cache.k[0], cache.v[0], None, mask,
                                    sm_scale=network.layer.sm_scale)
    return network.layer.finish(resid, out), cache

  def init(self, target: TargetView, prefill: Prefill) -> EagleState:
    network = self._network()
    b, p = prefill.prompt.shape
    cfg = target.config
    slots = prefill.history.shape[1] + self._tree_slots + self.depth + 1
    m = self.net.model  # the draft layer's own heads (a published head's may differ)
    cache = KVCache.init(1, b, slots, m.num_kv_heads, m.head_dim, self.head_dtype)
    feats = learned.concat_features(prefill.hidden).astype(self.head_dtype)  # [B, P, F]
    n_fed = prefill.hist_len - 2  # pairs 0 .. prompt_len - 2; the last one stays pending
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    emb = learned.embed(cfg, target.params, prefill.history[:, 1:p + 1]).astype(self.head_dtype)
    mask = attention.full_mask(jnp.zeros((b,), jnp.int32), decoder.causal_mask(n_fed, p), slots)
    _, cache = self._feed(network, network.features(feats), emb, positions, cache,
                          jnp.zeros((b,), jnp.int32), mask)
    pending = learned.take_rows(feats, n_fed)[:, None]
    pad = jnp.zeros((b, self._longest_path, feats.shape[-1]), feats.dtype)
    return EagleState(cache.replace(length=n_fed), jnp.concatenate([pending, pad], axis=1),
                      jnp.ones((b,), jnp.int32))

  @jax.named_scope("lm_head")
  def _logits(self, network, h: jax.Array, recent: learned.RecentVocab | None) -> jax.Array:
    """[B, ..., Vd (+ recent_tokens)] draft logits of h: [B, ..., E]."""
    return learned.with_recent(network.logits(h, self.head), network.head_input(h), recent)

  def draft(self, target: TargetView, state: EagleState, ctx: DraftContext):
    network = self._network()
    cfg = target.config
    b, rows = state.feats.shape[:2]
    c = state.cache.length
    slots = state.cache.max_len
    # Feed the pending pairs: row j = (target feature of position c + j, token c + j + 1).
    idx = c[:, None] + jnp.arange(rows)[None, :]
    toks = jnp.take_along_axis(ctx.history, jnp.clip(idx + 1, 0, ctx.history.shape[1] - 1), 1)
    emb = learned.embed(cfg, target.params, toks).astype(self.head_dtype)
    mask = attention.full_mask(c, decoder.causal_mask(state.n_new, rows), slots)
    out, cache = self._feed(network, network.features(state.feats), emb, idx, state.cache, c,
                            mask)
    h_root = learned.take_rows(out, state.n_new - 1)  # [B, E]
    c = c + state.n_new  # = hist_len - 1: the pairs up to pending are committed
    recent = self.recent_vocab(target, ctx)
    root_logp = learned.draft_logprobs(self._logits(network, h_root, recent))
    k, tree_slots = self.top_k, self._tree_slots

    def expand(carry, tokens, parent, level):
      cache, parent_h, anc = carry  # anc: [B, k, tree_slots] ancestor rows of the frontier
      h = jnp.take_along_axis(parent_h, parent[:, :, None], axis=1)
      own = (level - 1) * k + jnp.arange(k)
      anc = jnp.take_along_axis(anc, parent[:, :, None], axis=1) | (
          jnp.arange(tree_slots)[None, None, :] == own[None, :, None])
      emb = learned.embed(cfg, target.params, self.to_target_ids(tokens, recent)).astype(h.dtype)
      positions = jnp.broadcast_to((c + level - 1)[:, None], (b, k))
      out, cache = self._feed(network, h, emb, positions, cache, c + (level - 1) * k,
                              attention.full_mask(c, anc, slots))
      return learned.draft_logprobs(self._logits(network, out, recent)), (cache, out, anc)

    carry = (cache, h_root[:, None], jnp.zeros((b, 1, tree_slots), bool))
    grown, (cache, _, _) = trees.grow_dynamic_tree(
        root_logp, expand, carry, depth=self.depth, top_k=k, num_nodes=self.total_tokens,
        children=self.children, sampling=target.sampling, key=ctx.rng)
    tree = self.with_targets(grown.tree, recent)
    return tree, EagleState(cache.replace(length=c), state.feats, state.n_new), ctx.cache

  def update(self, target: TargetView, state: EagleState, result: RoundResult) -> EagleState:
    acc = result.acceptance
    feats = learned.concat_features(result.hidden).astype(state.feats.dtype)  # [B, N+1, F]
    # Pending + the accepted rows fit in longest path + 1 (the path's first entries).
    feats = jnp.take_along_axis(feats, acc.path[:, :self._longest_path + 1, None], axis=1)
    live = result.live
    return EagleState(state.cache, jnp.where(live[:, None, None], feats, state.feats),
                      jnp.where(live, acc.n_accepted + 1, state.n_new))


def check_tree_options(depth: int, top_k: int, total_tokens: int, vocab: int
                       ) -> tuple[int, int, int]:
  """The tree options as ints (numpy ints pass; floats, bools and strings do not)."""
  depth = checks.integer("depth", depth)
  top_k = checks.integer("top_k", top_k)
  total_tokens = checks.integer("total_tokens", total_tokens)
  if depth < 1 or top_k < 1:
    raise ValueError(f"depth and top_k must be >= 1, got depth={depth}, top_k={top_k}")
  if top_k > vocab:
    raise ValueError(f"top_k {top_k} exceeds the draft vocabulary ({vocab}): top_k must be in "
                     f"[1, {vocab}]")
  most = trees.grown_tree_capacity(depth, top_k)
  if not 1 <= total_tokens <= most:
    raise ValueError(f"total_tokens must be in [1, {most}] for depth {depth} and top_k "
                     f"{top_k}, got {total_tokens}")
  return depth, top_k, total_tokens


# Chains (top_k 1) first: where each verified node costs a visible fraction of a target step,
# narrow trees win; wider ones win where verification is nearly free (an accelerator).
TUNE_GRID = tuple(dict(depth=d, top_k=k, total_tokens=n) for d, k, n in
                  [(4, 1, 4), (5, 1, 5), (6, 1, 6), (7, 1, 7), (4, 2, 6), (5, 2, 8), (6, 2, 10),
                   (5, 3, 10), (7, 3, 16)])


class EagleFamily(learned.Family):
  """The family protocol's shared half for EAGLE-style drafters (EAGLE-2's dynamic tree):
  subclasses set the network (`module`, `config_cls`, `make_config`) and `depth_logits`."""

  def assemble(self, net, params, d2t, target, hidden_layers, *, depth: int = 6, top_k: int = 4,
               total_tokens: int = 16, recent_tokens: int = 0,
               children=learned.DEFAULT_CHILDREN, draft_temperature=None) -> EagleDrafter:
    """Tree options `depth`, `top_k`, `total_tokens` (EAGLE-2's dynamic tree), `recent_tokens`
    (`LearnedDrafter.recent_vocab`), `children` and `draft_temperature` (`specjax.children`);
    families that draft through the target's LM head get it restricted to the draft
    vocabulary."""
    depth, top_k, total_tokens = check_tree_options(depth, top_k, total_tokens, d2t.shape[0])
    recent_tokens = learned.check_recent_tokens(recent_tokens, target.config)
    head = learned.restricted_head(target.config, target.params, d2t).astype(
        net.dtype) if self.uses_target_head else None
    return EagleDrafter(params=params, d2t=d2t, head=head, recent_tokens=recent_tokens,
                        built_for=TargetFacts.of(target.config),
                        children=learned.check_children(children, draft_temperature),
                        module=self.module, net=net,
                        depth=depth, top_k=top_k, total_tokens=total_tokens,
                        hidden_layers=hidden_layers)

  def tree_options(self, spec: str) -> dict:
    """'d': a chain of d nodes; 'd x k x n' (e.g. '7x3x16'): depth d, top_k k, n nodes."""
    return learned.grown_tree_options(spec, self.name, "7x3x16")

  def tune_grid(self) -> list[dict]:
    return [dict(c) for c in TUNE_GRID]
