"""DFlash (block-parallel drafting): its attention, its trees, its state, files and training view.

  1. What it drafts is what it trained on: after prefill and real rounds through decoding's own
     jitted phases, the drafter's context cache holds hist_len - 1 positions and its block
     logits equal a cache-free `dflash.training_logits` over the history (target features
     recomputed, start hist_len - 2), with the same top-k per depth; the tree `draft` returns is
     `trees.tree_from_marginals` of those reference logits, in target ids. So too with the
     causal correction and with the anchor feature (every row of a ragged batch), whose
     untrained path changes nothing and which no published layout holds.
  2. `block_attention` (context and intra-block attention merged by log-sum-exp) equals one
     softmax over [context ; block] keys under the explicit mask, also for a block that sees no
     context (anchor 0).
  3. `trees.tree_from_marginals` against a brute-force best-first heap (pop the best rank path,
     push its next sibling and first child): the same set of token paths and scores,
     prefix-closed; top_k = 1 is the chain of argmaxes; static shapes under jit; clear errors
     for a node budget above `grown_tree_capacity` and top_k outside [1, V].
  4. Bad input, each a ValueError naming it: tree options that do not fit the block, block_size
     < 2, training configs (taps, train_steps, num_anchors), folders for another target, taps
     out of range, and a tap count that differs from the network's.
  5. Drafter folders: a save/load round trip (float32 and bfloat16 export); the own
     `mask_embedding`, or with `mask_token_id` the target's embedding row at the masked
     positions and no own vector.
  6. Random anchors: `sample_starts` rows are sorted, distinct, inside the row and fixed by the
     key; the trainer scores exactly the drawn starts (the dense view at those starts), and all
     starts give the dense loss.
(Greedy and sampling losslessness: tests/test_speculative.py; training runs:
tests/train/test_train_drafter.py.)
"""

from __future__ import annotations

import dataclasses
import heapq
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import trees
from specjax.config_utils import load_config
from specjax.drafters import dflash, io, learned
from specjax.drafters.base import DraftContext, TargetView
from specjax.sampling import SamplingConfig
from specjax.train import drafter as train_drafter
from tests.drafters.test_learned import PROMPT, _hidden, _rounds
from tests.helpers import tiny_targets as tt

V = tt.GREEDY_VOCAB
D2T = np.arange(0, V, 2)[::-1].copy()  # half the vocabulary, in an order of its own


@pytest.fixture(scope="module")
def target():
  return tt.greedy_target()


@pytest.fixture(scope="module")
def tree_drafter(target):
  return tt.learned_drafter("dflash", target, d2t=D2T, top_k=4, total_tokens=12)


def _view(target):
  return TargetView(target.config, SamplingConfig(), target.params)


def _ctx(state):
  return DraftContext(state.history, state.hist_len, state.pending, state.cache,
                      jax.random.key(0))


# ------------------------------------------------------------------------------------------------
# 1. Training-inference agreement


@pytest.mark.parametrize("rounds", [0, 4])
def test_block_logits_match_the_training_view(target, tree_drafter, rounds):
  """After prefill and `rounds` real rounds (partial acceptances), the context cache holds the
  committed positions but the pending one (length hist_len - 1), and the block anchored at the
  pending token gives the logits `training_logits` computes cache-free over the history for start
  hist_len - 2 (features recomputed by the target), so the drafter sees at inference exactly
  what it was trained on; the tree it drafts is `tree_from_marginals` of those logits."""
  drafter = tree_drafter
  state = _rounds(target, drafter, rounds)
  ds = state.drafter_state
  n = int(state.hist_len[0])
  assert n >= len(PROMPT) + rounds  # each round emits at least one token
  assert int(ds.cache.length[0]) == n - 1
  history = np.asarray(state.history[0, :n]).tolist()
  assert int(state.pending[0]) == history[-1]

  view, ctx = _view(target), _ctx(state)
  got, recent = drafter.block_logits(view, ds, ctx)
  assert recent is None and got.shape == (1, drafter.depth, D2T.size)
  feats = learned.concat_features(_hidden(target, history, drafter.hidden_layers))
  emb = learned.target_embedding(target.config, target.params)
  net = learned.merge(dflash.DFlashNet, drafter.net, drafter.params)
  ref = dflash.training_logits(net, drafter.net, feats, jnp.asarray([history], jnp.int32), emb,
                               drafter.head, jnp.asarray([[n - 2]], jnp.int32), drafter.depth)
  assert ref.shape == (drafter.depth, 1, 1, D2T.size)
  ref = np.asarray(ref[:, 0, 0])  # [depth, Vd]
  np.testing.assert_allclose(np.asarray(got[0]), ref, rtol=1e-4, atol=1e-4)
  for d in range(drafter.depth):
    np.testing.assert_array_equal(np.argsort(-np.asarray(got[0, d]), kind="stable")[:4],
                                  np.argsort(-ref[d], kind="stable")[:4])

  tree, _, _ = drafter.draft(view, ds, ctx)
  want = trees.tree_from_marginals(learned.draft_logprobs(jnp.asarray(ref)[None]),
                                   num_nodes=drafter.total_tokens, top_k=drafter.top_k).tree
  np.testing.assert_array_equal(np.asarray(tree.tokens[0]), D2T[np.asarray(want.tokens[0])])
  np.testing.assert_array_equal(np.asarray(tree.parent[0]), np.asarray(want.parent[0]))
  np.testing.assert_array_equal(np.asarray(tree.depth[0]), np.asarray(want.depth[0]))
  assert tree.draft is None  # deterministic children: recursive rejection needs no q


def perturbed_drafter(target, net_options: dict, **tree_options):
  """A random-weight DFlash built with `make_config` from `DFlashOptions(**net_options)`, every
  matrix perturbed (the correction's zero-initialised `up` projection too, so a correction is
  active)."""
  fam = dflash.FAMILY
  taps = fam.default_taps(target.config)
  net = fam.make_config(target.config, draft_vocab_size=D2T.size, num_features=len(taps),
                        options=dflash.DFlashOptions(**net_options))
  params = learned.init_params(dflash.DFlashNet, net, 0)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  params = jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                        if x.ndim >= 2 else x for x, k in zip(leaves, keys)])
  return fam.assemble(net, params, jnp.asarray(D2T), target, taps, **tree_options)


def corrected_drafter(target, rank: int = 8, **tree_options):
  """A random-weight DFlash with an active rank-`rank` causal correction."""
  return perturbed_drafter(target, dict(correction_rank=rank), **tree_options)


def test_draft_layers_with_more_kv_heads(target):
  """`num_kv_heads` widens the draft layers' K/V (here to one per attention head, where the
  target shares one): the context cache holds that many heads, the block logits still equal the
  training view's, greedy output still equals autoregressive decoding; a count that does not
  divide the heads is refused by name."""
  heads = target.config.num_heads
  assert target.config.num_kv_heads < heads
  drafter = perturbed_drafter(target, dict(num_kv_heads=heads), top_k=2, total_tokens=6)
  assert drafter.net.model.num_kv_heads == heads
  state = _rounds(target, drafter, 2)
  ds = state.drafter_state
  assert all(layer.shape[2] == heads for layer in ds.cache.k)
  n = int(state.hist_len[0])
  history = np.asarray(state.history[0, :n]).tolist()
  got, _ = drafter.block_logits(_view(target), ds, _ctx(state))
  feats = learned.concat_features(_hidden(target, history, drafter.hidden_layers))
  emb = learned.target_embedding(target.config, target.params)
  net = learned.merge(dflash.DFlashNet, drafter.net, drafter.params)
  ref = dflash.training_logits(net, drafter.net, feats, jnp.asarray([history], jnp.int32), emb,
                               drafter.head, jnp.asarray([[n - 2]], jnp.int32), drafter.depth)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[:, 0, 0]), rtol=1e-4, atol=1e-4)
  prompts = [PROMPT, [5, 6, 7, 5, 6, 7, 5]]
  ar = specjax.generate(target, prompts, max_new_tokens=24, pad_to=16).tokens
  assert specjax.generate(target, prompts, max_new_tokens=24, pad_to=16,
                          drafter=drafter).tokens == ar
  with pytest.raises(ValueError, match="num_kv_heads must divide"):
    dflash.FAMILY.make_config(target.config, draft_vocab_size=8, num_features=3,
                              options=dflash.DFlashOptions(num_kv_heads=heads + 1))


def test_corrected_tree_matches_the_training_view(target):
  """With the causal correction, depth d is conditioned on the token above it: the depth-1
  candidates equal the training view's (teacher forcing on the true next token = pending), and
  the children of the best depth-1 node equal the training view over the history extended by
  that node's token (depth 2 conditioned on it)."""
  drafter = corrected_drafter(target, top_k=3, total_tokens=9)
  state = _rounds(target, drafter, 3)
  ds = state.drafter_state
  n = int(state.hist_len[0])
  view, ctx = _view(target), _ctx(state)
  tree, _, _ = drafter.draft(view, ds, ctx)
  tokens, parent, depth = (np.asarray(x[0]) for x in (tree.tokens, tree.parent, tree.depth))
  top = int(tokens[0])
  history = np.asarray(state.history[0, :n]).tolist() + [top]
  feats = learned.concat_features(_hidden(target, history, drafter.hidden_layers))
  emb = learned.target_embedding(target.config, target.params)
  net = learned.merge(dflash.DFlashNet, drafter.net, drafter.params)
  ref = np.asarray(dflash.training_logits(
      net, drafter.net, feats, jnp.asarray([history], jnp.int32), emb, drafter.head,
      jnp.asarray([[n - 2]], jnp.int32), 2)[:, 0, 0])  # [2, Vd]
  level1 = D2T[np.argsort(-ref[0], kind="stable")[:3]]
  assert top == level1[0] and set(tokens[depth == 1].tolist()) <= set(level1.tolist())
  children = tokens[parent == 0]
  assert children.size and children[0] == D2T[np.argmax(ref[1])]
  assert set(children.tolist()) <= set(D2T[np.argsort(-ref[1], kind="stable")[:3]].tolist())
  prev = jnp.asarray([[history[n - 1], top] + [0] * (drafter.depth - 2)], jnp.int32)
  got, _ = drafter.block_logits(view, ds, ctx, prev=prev)
  np.testing.assert_allclose(np.asarray(got[0, :2]), ref, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="pass prev"):
    drafter.block_logits(view, ds, ctx)


def test_corrected_draft_lifts_the_head_through_the_correction(target):
  """`draft` scores a corrected depth as the uncorrected logits plus the correction's codes times
  the head lifted through `up` (the fixed vocabulary's part kept in the state, the recent ids'
  per round): to float rounding, the log-probabilities that applying the correction to the state
  and then the whole head gives, recent ids included, at every depth; and the tree it drafts is
  the one grown from those."""
  drafter = corrected_drafter(target, top_k=3, total_tokens=9, recent_tokens=8)
  state = _rounds(target, drafter, 3)
  ds = state.drafter_state
  view, ctx = _view(target), _ctx(state)
  net = learned.merge(dflash.DFlashNet, drafter.net, drafter.params)
  h = drafter._block(net, view, ds, ctx)
  recent = drafter.recent_vocab(view, ctx)
  assert recent is not None and bool(recent.live.any())  # ids outside the draft vocabulary

  def corrected(level, tokens):
    hk = jnp.broadcast_to(h[:, level, None], tokens.shape + h.shape[-1:])
    hk = net.correction(hk, learned.embed(target.config, target.params, tokens))
    return learned.draft_logprobs(drafter._head(hk, recent))

  lifted = drafter._corrected(net, view, ds, h, recent)
  tokens = jnp.asarray([[int(ctx.pending[0]), 3, 70]], jnp.int32)  # the tokens above, target ids
  for level in range(drafter.depth):
    got, want = np.asarray(lifted(level, tokens)), np.asarray(corrected(level, tokens))
    assert got.shape == (1, 3, D2T.size + 8)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5,
                               atol=1e-5)

  def expand(carry, tokens, parent, level):
    return corrected(level, drafter.to_target_ids(tokens, recent)), carry

  want, _ = trees.grow_dynamic_tree(corrected(0, ctx.pending[:, None])[:, 0], expand, (),
                                    depth=drafter.depth, top_k=drafter.top_k,
                                    num_nodes=drafter.total_tokens)
  tree, _, _ = drafter.draft(view, ds, ctx)
  np.testing.assert_array_equal(np.asarray(tree.tokens),
                                np.asarray(drafter.to_target_ids(want.tree.tokens, recent)))
  np.testing.assert_array_equal(np.asarray(tree.parent), np.asarray(want.tree.parent))


@pytest.mark.parametrize("net_options", [dict(correction_rank=8), dict(anchor_feature=True),
                                         dict(correction_rank=8, anchor_feature=True)])
def test_corrected_and_anchored_drafters_are_lossless(target, net_options):
  """Greedy output of DFlash with the causal correction, the anchor feature or both (chain and
  tree, a ragged batch) equals autoregressive decoding."""
  prompts = [PROMPT, [5, 6, 7, 5, 6, 7, 5]]
  ar = specjax.generate(target, prompts, max_new_tokens=32, pad_to=16).tokens
  for options in (dict(), dict(top_k=3, total_tokens=9),
                  dict(top_k=3, total_tokens=9, recent_tokens=8)):
    ours = specjax.generate(target, prompts, max_new_tokens=32, pad_to=16,
                            drafter=perturbed_drafter(target, net_options, **options))
    assert ours.tokens == ar, options


@pytest.mark.parametrize("rounds", [0, 3])
def test_anchor_feature_matches_the_training_view(target, rounds):
  """With the anchor feature each block also reads the fused context of the position before its
  anchor: after prefill and real rounds of a ragged batch (rows of different lengths and
  acceptances), the state holds each row's context at slot length - 1, and every row's block
  logits equal the cache-free training view over its own history."""
  drafter = perturbed_drafter(target, dict(anchor_feature=True), top_k=2, total_tokens=6)
  assert drafter.net.anchor_feature
  prompts = [PROMPT, [5, 6, 7, 5, 6, 7, 5]]
  state = _rounds(target, drafter, rounds, prompts)
  ds = state.drafter_state
  got, _ = drafter.block_logits(_view(target), ds, _ctx(state))
  emb = learned.target_embedding(target.config, target.params)
  net = learned.merge(dflash.DFlashNet, drafter.net, drafter.params)
  for row in range(len(prompts)):
    n = int(state.hist_len[row])
    assert int(ds.cache.length[row]) == n - 1
    history = np.asarray(state.history[row, :n]).tolist()
    feats = learned.concat_features(_hidden(target, history, drafter.hidden_layers))
    np.testing.assert_allclose(np.asarray(ds.last[row]), np.asarray(net.context(feats)[0, n - 2]),
                               rtol=1e-4, atol=1e-4)
    ref = dflash.training_logits(net, drafter.net, feats, jnp.asarray([history], jnp.int32),
                                 emb, drafter.head, jnp.asarray([[n - 2]], jnp.int32),
                                 drafter.depth)
    np.testing.assert_allclose(np.asarray(got[row]), np.asarray(ref[:, 0, 0]), rtol=1e-4,
                               atol=1e-4)


def test_anchor_feature_is_trained_from_zero_and_has_no_published_layout(target, tmp_path):
  """An untrained anchor path (`anchor_proj` starts at zero) leaves the block logits of the plain
  network unchanged; the option survives a drafter folder's round trip; the published DFlash
  layout, which has no such weights, refuses it by name."""
  fam = dflash.FAMILY
  taps = fam.default_taps(target.config)
  plain = fam.make_config(target.config, draft_vocab_size=D2T.size, num_features=len(taps))
  anchored = dataclasses.replace(plain, anchor_feature=True)
  params = learned.init_params(dflash.DFlashNet, anchored, 0)
  assert not np.any(np.asarray(params["anchor_proj"]["kernel"][...]))
  plain_params = learned.init_params(dflash.DFlashNet, plain, 0)
  tokens = jnp.asarray([PROMPT], jnp.int32)
  feats = learned.concat_features(_hidden(target, PROMPT, taps))
  emb = learned.target_embedding(target.config, target.params)
  head = learned.restricted_head(target.config, target.params, jnp.asarray(D2T))
  starts = jnp.asarray([[0, 4, 9]], jnp.int32)
  views = [dflash.training_logits(learned.merge(dflash.DFlashNet, net, p), net, feats, tokens,
                                  emb, head, starts, 3)
           for net, p in ((plain, plain_params), (anchored, params))]
  np.testing.assert_array_equal(np.asarray(views[0]), np.asarray(views[1]))

  drafter = perturbed_drafter(target, dict(anchor_feature=True))
  io.save_drafter(tmp_path / "d", "dflash", drafter.net, drafter.params, drafter.d2t,
                  target.config, hidden_layers=drafter.hidden_layers)
  loaded = io.load_drafter(tmp_path / "d", target)
  assert loaded.net == drafter.net and loaded.net.anchor_feature
  with pytest.raises(ValueError, match="anchor feature"):
    io.export_drafter(tmp_path / "published", drafter, target, "dflash")


# ------------------------------------------------------------------------------------------------
# 2. Block attention


def _dense_attention(q, k, v, ctx_k, ctx_v, ctx_mask, scale):
  """One softmax per block over [context ; block] keys under the explicit mask, in float64."""
  q, k, v, ctx_k, ctx_v = (np.asarray(x, np.float64) for x in (q, k, v, ctx_k, ctx_v))
  b, n, p, h, d = q.shape
  group = h // k.shape[3]
  keys = np.concatenate([np.broadcast_to(ctx_k[:, None], (b, n) + ctx_k.shape[1:]), k], axis=2)
  vals = np.concatenate([np.broadcast_to(ctx_v[:, None], (b, n) + ctx_v.shape[1:]), v], axis=2)
  keys, vals = np.repeat(keys, group, axis=3), np.repeat(vals, group, axis=3)  # [B, N, S+P, H, D]
  mask = np.concatenate([np.asarray(ctx_mask), np.ones((b, n, p), bool)], axis=2)
  scores = np.einsum("bnphd,bnshd->bnphs", q, keys) * scale
  scores = np.where(mask[:, :, None, None, :], scores, -np.inf)
  w = np.exp(scores - scores.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("bnphs,bnshd->bnphd", w, vals)


def test_block_attention_equals_the_dense_masked_softmax():
  b, n, p, h, kv, d, s = 2, 4, 3, 4, 2, 8, 6
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (b, n, p, h, d))
  k, v = (jax.random.normal(x, (b, n, p, kv, d)) for x in keys[1:3])
  ctx_k, ctx_v = (jax.random.normal(x, (b, s, kv, d)) for x in keys[3:5])
  # Row 0: prefix masks of the anchors 0 (no context at all), 1, 4 and 6 (all of it); row 1: an
  # empty block and arbitrary (non-prefix) masks.
  seen = np.asarray([0, 1, 4, 6])
  prefix = np.arange(s)[None, :] < seen[:, None]
  other = np.random.default_rng(0).random((n, s)) < 0.5
  other[1] = False
  ctx_mask = jnp.asarray(np.stack([prefix, other]))
  scale = d ** -0.5
  got = dflash.block_attention(q, k, v, ctx_k, ctx_v, ctx_mask, scale)
  assert got.shape == q.shape and bool(jnp.all(jnp.isfinite(got)))
  want = _dense_attention(q, k, v, ctx_k, ctx_v, ctx_mask, scale)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  # A block that sees no context attends to itself alone, whatever the context holds.
  alone = dflash.block_attention(q, k, v, ctx_k * 7.0, ctx_v - 3.0, ctx_mask, scale)
  np.testing.assert_allclose(np.asarray(alone[0, 0]), np.asarray(got[0, 0]), rtol=1e-6,
                             atol=1e-6)


# ------------------------------------------------------------------------------------------------
# 3. Trees from per-depth marginals


def _best_first(logp: np.ndarray, num_nodes: int):
  """DDTree's best-first heap over rank paths, in plain Python: {token path: score}."""
  order = np.argsort(-logp, axis=-1, kind="stable")  # [D, V]
  depth, v = logp.shape

  def score(ranks):
    return sum(float(logp[i, order[i, r]]) for i, r in enumerate(ranks))

  heap, out = [(-score((0,)), (0,))], {}
  while heap and len(out) < num_nodes:
    neg, ranks = heapq.heappop(heap)
    out[tuple(int(order[i, r]) for i, r in enumerate(ranks))] = -neg
    if ranks[-1] + 1 < v:
      sibling = ranks[:-1] + (ranks[-1] + 1,)
      heapq.heappush(heap, (-score(sibling), sibling))
    if len(ranks) < depth:
      child = ranks + (0,)
      heapq.heappush(heap, (-score(child), child))
  return out


def _paths(tree, row: int):
  tokens, parent = np.asarray(tree.tokens[row]), np.asarray(tree.parent[row])
  paths = []
  for i, (tok, par) in enumerate(zip(tokens.tolist(), parent.tolist())):
    assert -1 <= par < i  # parents precede children
    paths.append((paths[par] if par >= 0 else ()) + (tok,))
  return paths


@pytest.mark.parametrize("depth,num_nodes", [(1, 1), (1, 6), (3, 7), (4, 12), (6, 25)])
def test_tree_from_marginals_is_the_best_first_tree(depth, num_nodes):
  v, b = 11, 2
  rng = np.random.default_rng(10 * depth + num_nodes)
  logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, depth, v)) * 2, jnp.float32))
  grown = jax.jit(lambda x: trees.tree_from_marginals(x, num_nodes=num_nodes))(logp)
  tree = grown.tree
  assert tree.tokens.shape == tree.parent.shape == grown.score.shape == (b, num_nodes)
  trees.validate(tree, v)
  for row in range(b):
    paths = _paths(tree, row)
    assert len(set(paths)) == num_nodes
    assert all(len(p) == 1 or p[:-1] in paths for p in paths)  # prefix-closed
    want = _best_first(np.asarray(logp[row]), num_nodes)
    assert set(paths) == set(want)
    np.testing.assert_allclose(np.asarray(grown.score[row]), [want[p] for p in paths],
                               rtol=1e-5, atol=1e-5)


def test_tree_from_marginals_chain_and_errors():
  v, depth = 9, 5
  logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (2, depth, v)) * 3)
  chain = trees.tree_from_marginals(logp, num_nodes=depth, top_k=1).tree
  np.testing.assert_array_equal(np.asarray(chain.tokens), np.asarray(jnp.argmax(logp, -1)))
  np.testing.assert_array_equal(np.asarray(chain.parent), np.tile(np.arange(-1, depth - 1),
                                                                  (2, 1)))
  assert trees.grown_tree_capacity(depth, 2) == 2 + 4 * 4
  with pytest.raises(ValueError, match=r"num_nodes must be in \[1, 18\] for depth 5 and top_k 2, "
                     r"got 19"):
    trees.tree_from_marginals(logp, num_nodes=19, top_k=2)
  with pytest.raises(ValueError, match=r"num_nodes must be in \[1, 5\] for depth 5 and top_k 1"):
    trees.tree_from_marginals(logp, num_nodes=6, top_k=1)
  for k in (0, v + 1):
    with pytest.raises(ValueError, match=rf"top_k must be in \[1, {v}\] .*got {k}"):
      trees.tree_from_marginals(logp, num_nodes=3, top_k=k)


# ------------------------------------------------------------------------------------------------
# 4. Bad input


@pytest.mark.parametrize("options,message", [
    (dict(depth=8), r"depth 8 does not fit the drafter's block: a block of 8 drafts depths 1\.\.7"),
    (dict(depth=0), r"depth 0 does not fit"),
    (dict(depth=3, top_k=2, total_tokens=11),
     r"total_tokens must be in \[1, 10\] for depth 3 and top_k 2 \(a block of 8\), got 11"),
    (dict(depth=3, top_k=2, total_tokens=0), r"total_tokens must be in \[1, 10\].*got 0"),
    (dict(top_k=V + 1), rf"top_k must be in \[1, {V}\] \(the draft vocabulary\), got {V + 1}"),
    (dict(depth=2.5), r"depth must be an int, got 2\.5"),
])
def test_tree_options_must_fit_the_block(target, options, message):
  with pytest.raises(ValueError, match=message):
    tt.learned_drafter("dflash", target, **options)


def test_block_size_and_mask_row_are_checked(target):
  with pytest.raises(ValueError, match=r"DFlash block_size must be an int >= 2 .*got 1"):
    dflash.DFlashConfig(target.config, block_size=1)
  with pytest.raises(ValueError, match=r"DFlashOptions\.block_size must be an int >= 2, got 1"):
    dflash.DFlashOptions(block_size=1)  # what make_config builds from
  with pytest.raises(ValueError, match=rf"mask_token_id {V} is outside the target vocabulary"):
    dflash.FAMILY.make_config(target.config, draft_vocab_size=V, num_features=2,
                              mask_token_id=V)
  net = dflash.FAMILY.make_config(target.config, draft_vocab_size=V, num_features=2,
                                  options=dflash.DFlashOptions(block_size=4))
  x = learned.DepthInputs(None, None, jnp.zeros((1, 8), jnp.int32), None, None)
  with pytest.raises(ValueError, match=r"a block of 4 drafts depths 1\.\.3, asked for 4"):
    dflash.FAMILY.depth_logits(net, None, x, 4)


@pytest.mark.parametrize("overrides,message", [
    (["family.block_size=1"], r"block_size must be an int >= 2, got '1'"),
    (["train_steps=8"], r"train_steps and eval_depth must be at most block_size - 1 = 7 .*got 8"),
    (["family.block_size=4"], r"must be at most block_size - 1 = 3 .*got 7"),
    (["family.num_anchors=256"], r"num_anchors must be in \[1, 255\] for rows of 256 tokens, "
     r"got 256"),
    (["family.num_anchors=-1"], r"num_anchors must be an int >= 0, got '-1'"),
    (["source=corpus", "seq_len=32"], r"num_anchors must be in \[1, 31\] for rows of 32 tokens, "
     r"got 64"),
    (["family.target_layers=2,2"], r"target_layers must be distinct layer ids"),
    (["family.num_heads=3"], r"num_heads is not an option of dflash"),
])
def test_bad_training_configs_are_rejected(overrides, message):
  with pytest.raises(ValueError, match=message):
    load_config("configs/dflash_stdlib.py", overrides)


def test_training_taps_must_be_inside_the_target(target):
  cfg = load_config("configs/dflash_stdlib.py", ["family.target_layers=1,3"])
  with pytest.raises(ValueError, match=r"target_layers \[3\] are outside \[0, 2\]"):
    train_drafter.taps(cfg, target)
  # A negative id is refused with the config itself, before any target is known.
  with pytest.raises(ValueError, match=r"target_layers\[0\] must be an int >= 0, got '-1'"):
    load_config("configs/dflash_stdlib.py", ["family.target_layers=-1,2"])
  assert train_drafter.taps(load_config("configs/dflash_stdlib.py"), target) == (1, 2)
  assert load_config("configs/dflash_stdlib.py").family.num_anchors == 64  # the recipe's anchors


@pytest.fixture()
def saved(target, tmp_path):
  drafter = tt.learned_drafter("dflash", target)
  io.save_drafter(tmp_path, "dflash", drafter.net, drafter.params, drafter.d2t, target.config)
  return tmp_path


@pytest.mark.parametrize("change,message", [
    (dict(vocab_size=tt.GREEDY_VOCAB + 1), "vocab_size"),
    (dict(hidden_size=64, intermediate_size=128), "hidden_size"),
    (dict(num_layers=3), "num_layers"),
])
def test_load_refuses_another_target(saved, change, message):
  other = specjax.Target.random(tt.GREEDY_CONFIG.replace(**change), seed=0)
  with pytest.raises(ValueError, match=f"trained for a target with {message}"):
    io.load_drafter(saved, other)


def _edit_taps(folder, layers):
  config = json.loads((folder / "config.json").read_text())
  config["hidden_layers"] = layers
  (folder / "config.json").write_text(json.dumps(config))


def test_load_refuses_taps_outside_the_target_or_of_another_count(saved, target):
  _edit_taps(saved, [1, 5])
  with pytest.raises(ValueError, match=r"reads hidden layer 5, outside \[0, 2\]"):
    io.load_drafter(saved, target)
  _edit_taps(saved, [2])
  with pytest.raises(ValueError, match=r"the DFlash network fuses 2 target layers, "
                     r"hidden_layers has 1"):
    io.load_drafter(saved, target)
  _edit_taps(saved, [0, 2])  # another pair of taps of the right count loads
  assert io.load_drafter(saved, target).hidden_layers == (0, 2)
  with pytest.raises(ValueError, match=r"depth 9 does not fit the drafter's block"):
    io.load_drafter(saved, target, depth=9)


# ------------------------------------------------------------------------------------------------
# 5. Drafter folders


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_save_load_round_trip(target, tmp_path, dtype):
  drafter = tt.learned_drafter("dflash", target, seed=3, d2t=D2T)
  assert "mask_embedding" in drafter.params  # no mask_token_id: its own vector
  io.save_drafter(tmp_path, "dflash", drafter.net, drafter.params, drafter.d2t, target.config,
                  dtype=dtype)
  loaded = io.load_drafter(tmp_path, target, top_k=2, total_tokens=9)
  assert type(loaded) is dflash.DFlashDrafter and loaded.net == drafter.net
  assert (loaded.depth, loaded.top_k, loaded.num_nodes) == (7, 2, 9)
  assert loaded.hidden_layers == drafter.hidden_layers
  cast = jnp.bfloat16 if dtype else jnp.float32
  for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(loaded.params), strict=True):
    assert b.dtype == jnp.float32  # loaded at the target's dtype
    np.testing.assert_array_equal(np.asarray(a.astype(cast).astype(jnp.float32)), np.asarray(b))
  np.testing.assert_array_equal(loaded.d2t, D2T)
  np.testing.assert_array_equal(loaded.head, drafter.head)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["method"] == "dflash" and config["net"]["block_size"] == 8
  assert config["net"]["mask_token_id"] is None


def test_mask_token_id_embeds_the_targets_row(target, tmp_path):
  """With `mask_token_id` the block's masked positions embed that row of the target's table:
  the network has no own mask vector and drafts exactly what a network whose own vector is that
  row drafts; the folder keeps the id."""
  row = 7
  own = tt.learned_drafter("dflash", target)
  net_id = dataclasses.replace(own.net, mask_token_id=row)
  assert "mask_embedding" not in learned.init_params(dflash.DFlashNet, net_id, 0)
  params = nnx.State({k: v for k, v in own.params.items() if k != "mask_embedding"})
  emb = learned.target_embedding(target.config, target.params)
  id_net = learned.merge(dflash.DFlashNet, net_id, params)
  own_params = nnx.State(dict(params.items()) | {"mask_embedding": nnx.Param(emb[row])})
  own_net = learned.merge(dflash.DFlashNet, own.net, own_params)
  tokens = jnp.asarray([PROMPT], jnp.int32)
  x = id_net.embed_blocks(emb[tokens[:, :2]], id_net.mask_row(emb, row), 8)
  np.testing.assert_array_equal(np.asarray(x[0, :, 1:]),
                                np.broadcast_to(emb[row], (2, 7, emb.shape[1])))
  np.testing.assert_array_equal(np.asarray(x[0, :, 0]), np.asarray(emb[tokens[0, :2]]))
  feats = learned.concat_features(_hidden(target, PROMPT, own.hidden_layers))
  starts = jnp.asarray([[0, 3, 9]], jnp.int32)
  got = dflash.training_logits(id_net, net_id, feats, tokens, emb, own.head, starts, 7)
  want = dflash.training_logits(own_net, own.net, feats, tokens, emb, own.head, starts, 7)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

  io.save_drafter(tmp_path, "dflash", net_id, params, own.d2t, target.config)
  loaded = io.load_drafter(tmp_path, target)
  assert loaded.net.mask_token_id == row and "mask_embedding" not in loaded.params


# ------------------------------------------------------------------------------------------------
# 6. Random anchors


def test_sample_starts_are_sorted_distinct_and_keyed():
  key = jax.random.key(5)
  starts = np.asarray(dflash.sample_starts(key, 4, 20, 6))
  assert starts.shape == (4, 6) and starts.dtype == np.int32
  assert (np.diff(starts, axis=1) > 0).all()  # sorted and distinct
  assert starts.min() >= 0 and starts.max() <= 18  # the depth-1 target t + 2 - 1 is in the row
  np.testing.assert_array_equal(starts, np.asarray(dflash.sample_starts(key, 4, 20, 6)))
  assert not np.array_equal(starts, np.asarray(dflash.sample_starts(jax.random.key(6), 4, 20, 6)))
  assert len({tuple(r) for r in starts.tolist()}) > 1  # rows draw their own anchors
  np.testing.assert_array_equal(np.asarray(dflash.sample_starts(key, 2, 20, 19)),
                                np.tile(np.arange(19), (2, 1)))
  for num in (0, 20):
    with pytest.raises(ValueError, match=rf"num_anchors must be in \[1, 19\] for rows of 20 "
                       rf"tokens, got {num}"):
      dflash.sample_starts(key, 4, 20, num)


def test_trainer_scores_exactly_the_drawn_anchors(target):
  """`drafter_loss` with num_anchors scores the starts `sample_starts` draws from the step's key
  (fold_in(key, 1)), each as the dense training view scores it (a block does not depend on the
  other blocks in the batch); all T - 1 starts give the dense loss."""
  drafter = tt.learned_drafter("dflash", target)
  b, t, steps = 2, 16, 7
  setup = train_drafter._Setup(dflash.FAMILY, drafter.net, target.config, drafter.hidden_layers)
  emb = learned.target_embedding(target.config, target.params)
  frozen = train_drafter.Frozen(target=target.params, d2t=drafter.d2t, emb=emb,
                                head=drafter.head)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (b, t)), jnp.int32)
  key = jax.random.key(11)
  batch = train_drafter.DrafterBatch(frozen, tokens, key)

  def loss(num_anchors):
    cfg = load_config("configs/dflash_stdlib.py", [f"family.num_anchors={num_anchors}"])
    assert cfg.train_steps == steps
    return jax.jit(lambda p, x: train_drafter.drafter_loss(setup, cfg, p, x))(drafter.params,
                                                                               batch)

  dense_total, dense = loss(0)
  all_total, every = loss(t - 1)
  np.testing.assert_allclose(float(all_total), float(dense_total), rtol=1e-5)
  for s in range(steps):
    np.testing.assert_allclose(float(every[f"ce_{s + 1}"]), float(dense[f"ce_{s + 1}"]),
                               rtol=1e-5)

  num = 5
  total, metrics = loss(num)
  starts = np.asarray(dflash.sample_starts(jax.random.fold_in(key, 1), b, t, num))
  feats, logits = train_drafter._target_view(setup, frozen, tokens)
  x = learned.DepthInputs(feats, feats, tokens, emb, drafter.head)
  view, _ = dflash.FAMILY.depth_logits(drafter.net, drafter.params, x, steps)  # [S, B, T, V]
  view, logits = np.asarray(view, np.float64), np.asarray(logits, np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want_total = 0.0
  for s in range(steps):
    ce, count = 0.0, 0
    for row in range(b):
      for start in starts[row]:
        label = start + s + 1
        if label >= t:
          continue
        z = view[s, row, start]
        logq = z - z.max() - np.log(np.exp(z - z.max()).sum())
        ce, count = ce - (p[row, label] * logq).sum(), count + 1
    want = ce / max(count, 1)
    np.testing.assert_allclose(float(metrics[f"ce_{s + 1}"]), want, rtol=1e-4)
    want_total += load_config("configs/dflash_stdlib.py").step_decay ** s * want
  np.testing.assert_allclose(float(total), want_total, rtol=1e-4)
  assert abs(float(total) - float(dense_total)) > 1e-4  # a subset of the starts, not all
