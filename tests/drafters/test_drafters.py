"""Each drafter's own logic, independent of verification: what it proposes and what it keeps.

Drafters are called directly through the protocol (`init` / `draft` / `update`) on hand-made
inputs and compared with small independent references (a Python n-gram search, a walk of the
template's paths, a cache-free forward of the model), plus the registry's contract. Only the
layer-skip and draft-LM sync checks run `generate`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import drafters, trees
from specjax.drafters import draft_lm, ngram, prompt_lookup, token_recycling
from specjax.drafters.base import DraftContext, Prefill, RoundResult, TargetView
from specjax.drafters.oracle import Oracle
from specjax.models import decoder
from specjax.sampling import SamplingConfig, target_probs
from specjax.verify import Acceptance
from tests.helpers import tiny_targets as tt

GREEDY = SamplingConfig()
TOP_P = SamplingConfig(0.7, top_p=0.9)


@pytest.fixture(scope="module")
def target():
  return tt.greedy_target()


def _view(target, sampling=GREEDY) -> TargetView:
  return TargetView(target.config, sampling, target.params)


def _padded(rows, width, fill=0) -> np.ndarray:
  out = np.full((len(rows), width), fill, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


def _prefill_cache(model, prompts, width, fill=0):
  """The prefill output and the cache after a prefill of `prompts` right-padded with `fill`
  (cache length advanced to each prompt's length)."""
  cfg, p = model.config, max(map(len, prompts))
  tokens = jnp.asarray(_padded(prompts, p, fill))
  lens = jnp.asarray([len(r) for r in prompts], jnp.int32)
  out = decoder.forward(cfg, model.params, tokens, jnp.broadcast_to(jnp.arange(p), tokens.shape),
                        decoder.causal_mask(lens, p), decoder.init_cache(cfg, len(prompts), width),
                        hidden_layers=(cfg.num_layers,))
  return out, out.cache.advance(lens)


# ------------------------------------------------------------------------------------------------
# prompt_lookup


def _reference_branches(history, num_tokens, num_branches, max_ngram, min_ngram):
  """The documented rule in plain Python: continuation starts c (c < len) whose preceding n tokens
  equal the history's last n, ranked by longest n then most recent c; a branch is the num_tokens
  tokens from c (None past the history); later branches skip starts whose first token an earlier
  branch already proposed. Returns num_branches lists (all None for a missing branch)."""
  h, n_hist = list(history), len(history)
  best = {}
  for n in range(min_ngram, max_ngram + 1):
    for c in range(n, n_hist):
      if n_hist >= n and h[c - n:c] == h[n_hist - n:]:
        best[c] = n
  branches, used = [], set()
  for c in sorted(best, key=lambda c: (best[c], c), reverse=True):
    if h[c] not in used and len(branches) < num_branches:
      used.add(h[c])
      branches.append([h[c + i] if c + i < n_hist else None for i in range(num_tokens)])
  return branches + [[None] * num_tokens] * (num_branches - len(branches))


def _lookup(drafter, rows, width=16, junk=()):
  """Runs `draft` on histories `rows` (junk tokens after each history) -> (tokens, valid, tree),
  with the view of a target of 16 ids (the n-gram model counts over its vocabulary; prompt
  lookup reads no target)."""
  history = _padded([list(r) + list(junk) for r in rows], width)
  ctx = DraftContext(jnp.asarray(history), jnp.asarray([len(r) for r in rows], jnp.int32),
                     jnp.asarray([r[-1] for r in rows], jnp.int32), None, None)
  view = TargetView(tt.config(16), GREEDY, None)
  tree, _, _ = jax.jit(lambda c: drafter.draft(view, (), c))(ctx)
  return np.asarray(tree.tokens), np.asarray(tree.valid), tree


def _as_branches(tokens, valid, num_branches):
  t = np.where(valid, tokens, -1).reshape(num_branches, -1)
  return [[None if x < 0 else int(x) for x in b] for b in t]


def test_prompt_lookup_hand_made_history():
  """History 1 2 3 4 9 2 3 5 8 2 3: no earlier 3-gram '8 2 3'; the 2-gram '2 3' occurred twice,
  so branch 1 is the most recent continuation (5 8 2 3, then past the history: invalid) and
  branch 2 the older one (4 9 2 3 5 8); no third start remains: all invalid. The junk after the
  history ('2 3 7 7 7' would match) is never read. The tree is 3 chains under the root."""
  drafter = drafters.build("prompt_lookup", None, num_tokens=6, num_branches=3)
  history = [1, 2, 3, 4, 9, 2, 3, 5, 8, 2, 3]
  tokens, valid, tree = _lookup(drafter, [history], junk=[2, 3, 7, 7, 7])
  assert _as_branches(tokens[0], valid[0], 3) == [
      [5, 8, 2, 3, None, None], [4, 9, 2, 3, 5, 8], [None] * 6]
  parent, depth = prompt_lookup.branch_structure(3, 6)
  np.testing.assert_array_equal(parent, [-1, 0, 1, 2, 3, 4, -1, 6, 7, 8, 9, 10,
                                        -1, 12, 13, 14, 15, 16])
  np.testing.assert_array_equal(depth, list(range(1, 7)) * 3)
  np.testing.assert_array_equal(tree.parent[0], parent)
  trees.validate(tree, vocab_size=16)  # children of invalid nodes are invalid, and so on


def test_prompt_lookup_branches_start_with_distinct_tokens():
  """History 7 5 1 7 5 1 7 2 7: the unigram '7' continues at 7 (most recent: '2 7 ..'), 4 and 1
  (both '5 1 7'): the third start would duplicate the second branch's first token, so it is
  skipped and the third branch is invalid."""
  drafter = drafters.build("prompt_lookup", None, num_tokens=3, num_branches=3)
  tokens, valid, _ = _lookup(drafter, [[7, 5, 1, 7, 5, 1, 7, 2, 7]])
  assert _as_branches(tokens[0], valid[0], 3) == [[2, 7, None], [5, 1, 7], [None] * 3]


def test_prompt_lookup_no_match_is_all_invalid():
  """A history of distinct tokens has no earlier occurrence of its suffix: nothing is proposed."""
  drafter = drafters.build("prompt_lookup", None, num_tokens=4, num_branches=2)
  _, valid, _ = _lookup(drafter, [[1, 2, 3, 4, 5, 6, 7, 8], [9]])
  assert not valid.any()


@pytest.mark.parametrize("num_tokens,num_branches,max_ngram,min_ngram",
                         [(4, 2, 3, 1), (3, 4, 2, 2), (5, 1, 4, 1)])
def test_prompt_lookup_matches_reference_on_random_histories(num_tokens, num_branches, max_ngram,
                                                             min_ngram):
  """64 random histories over 4 tokens (many repeats), lengths 1..24, in one batch: the drafted
  branches equal the plain-Python reference token for token, with the same validity."""
  drafter = drafters.build("prompt_lookup", None, num_tokens=num_tokens,
                           num_branches=num_branches, max_ngram=max_ngram, min_ngram=min_ngram)
  rng = np.random.default_rng(num_tokens * 10 + num_branches)
  rows = [rng.integers(0, 4, int(rng.integers(1, 25))).tolist() for _ in range(64)]
  tokens, valid, _ = _lookup(drafter, rows, width=32, junk=rng.integers(0, 4, 8).tolist())
  for b, row in enumerate(rows):
    assert _as_branches(tokens[b], valid[b], num_branches) == _reference_branches(
        row, num_tokens, num_branches, max_ngram, min_ngram), f"row {b}: {row}"


# ------------------------------------------------------------------------------------------------
# ngram


def _reference_ngram(history, num_tokens, max_ngram, min_ngram, match_scale):
  """The documented rule in plain Python: each next token is the continuation (at a position c <
  len(history), so from the history only) seen most often after the longest suffix of history +
  draft, of order max_ngram down to min_ngram, that occurred before; ties go to the token seen
  last; no match ends the draft. The draft keeps floor(match_scale * m) tokens, at most
  num_tokens, m the longest suffix of the history that occurred before. Returns num_tokens
  entries, None where invalid."""
  h, n_hist = list(history), len(history)

  def starts(seq, n):
    return [c for c in range(n, n_hist) if len(seq) >= n and seq[c - n:c] == seq[len(seq) - n:]]

  longest = max([n for n in range(1, n_hist + 1) if starts(h, n)], default=0)
  length = num_tokens if match_scale is None else min(num_tokens, int(match_scale * longest))
  seq, out = list(h), []
  for _ in range(num_tokens):
    found = [starts(seq, n) for n in range(max_ngram, min_ngram - 1, -1)]
    cs = next((f for f in found if f), None)
    if cs is None:
      break
    count = {t: sum(h[c] == t for c in cs) for t in {h[c] for c in cs}}
    token = max(count, key=lambda t: (count[t], max(c for c in cs if h[c] == t)))
    out.append(token)
    seq.append(token)
  out = out[:length]
  return out + [None] * (num_tokens - len(out))


def test_ngram_hand_made_history():
  """History 5 1 2 5 1 3 5 1 2 7 5 1: the 3-gram '7 5 1' never occurred before, the 2-gram '5 1'
  did three times, continued by 2, 3, 2: the most frequent, 2, is drafted (prompt lookup would
  copy the most recent continuation, 2 7 5 1). Then '5 1 2' was continued by 5 and by 7, once
  each: the most recent, 7; then '1 2 7' -> 5, '2 7 5' -> 1, and '5 1' -> 2 again. The longest
  earlier suffix of the history is '5 1', so with match_scale 1.5 floor(1.5 * 2) = 3 tokens are
  kept. The junk after the history (which would extend the 3-gram match) is never read."""
  history = [5, 1, 2, 5, 1, 3, 5, 1, 2, 7, 5, 1]
  full = drafters.build("ngram", None, num_tokens=5, match_scale=None)
  scaled = drafters.build("ngram", None, num_tokens=5, match_scale=1.5)
  for drafter, keep in ((full, 5), (scaled, 3)):
    tokens, valid, tree = _lookup(drafter, [history], width=20, junk=[5, 1, 9, 9, 9])
    expect = [2, 7, 5, 1, 2][:keep] + [None] * (5 - keep)
    assert [int(t) if v else None for t, v in zip(tokens[0], valid[0])] == expect
    assert tree.chain
    trees.validate(tree, vocab_size=16)  # an invalid node's token is an id too


def test_ngram_no_match_is_all_invalid():
  """A history of distinct tokens has no earlier occurrence of its last token: nothing is
  proposed, and every node's token is still an id (invalid nodes are embedded)."""
  drafter = drafters.build("ngram", None, num_tokens=4, match_scale=None)
  tokens, valid, tree = _lookup(drafter, [[1, 2, 3, 4, 5, 6, 7, 8], [9]])
  assert not valid.any()
  trees.validate(tree, vocab_size=16)


@pytest.mark.parametrize("num_tokens,max_ngram,min_ngram,match_scale",
                         [(4, 3, 1, None), (6, 2, 1, 1.0), (5, 4, 2, 0.5), (3, 1, 1, 2.0)])
def test_ngram_matches_reference_on_random_histories(num_tokens, max_ngram, min_ngram,
                                                     match_scale):
  """64 random histories over 4 tokens (many repeats), lengths 1..24, in one batch: the drafted
  chains equal the plain-Python reference token for token, with the same validity."""
  drafter = drafters.build("ngram", None, num_tokens=num_tokens, max_ngram=max_ngram,
                           min_ngram=min_ngram, match_scale=match_scale)
  rng = np.random.default_rng(num_tokens * 10 + max_ngram)
  rows = [rng.integers(0, 4, int(rng.integers(1, 25))).tolist() for _ in range(64)]
  tokens, valid, tree = _lookup(drafter, rows, width=32,
                                      junk=rng.integers(0, 4, 8).tolist())
  trees.validate(tree, vocab_size=16)
  for b, row in enumerate(rows):
    got = [int(t) if v else None for t, v in zip(tokens[b], valid[b])]
    assert got == _reference_ngram(row, num_tokens, max_ngram, min_ngram, match_scale), (
        f"row {b}: {row}")


def test_ngram_most_frequent_breaks_ties_by_recency():
  """Counts over the candidate positions only; equal counts go to the token whose last
  candidate is latest; no candidate gives token 0 and found False."""
  tokens = jnp.asarray([4, 7, 4, 7, 9, 9, 7, 1], jnp.int32)
  pick = jax.jit(ngram.most_frequent, static_argnums=2)
  every = jnp.ones(8, bool)
  assert [int(x) for x in pick(tokens, every, 16)] == [7, 1]  # 7 three times
  some = jnp.asarray([1, 1, 1, 1, 1, 1, 0, 0], bool)  # 4, 7, 9 twice each: 9 is latest
  assert [int(x) for x in pick(tokens, some, 16)] == [9, 1]
  assert [int(x) for x in pick(tokens, jnp.zeros(8, bool), 16)] == [0, 0]


# ------------------------------------------------------------------------------------------------
# token_recycling


def _top_k(logits, k):
  return np.argsort(-np.asarray(logits), axis=-1, kind="stable")[..., :k]


def test_token_recycling_init_seeds_the_prompt_tokens(target):
  """After the prefill, the row of each prompt token holds the top-k of the target's logits right
  after it (here from a cache-free forward); rows of padding tokens and of unseen tokens keep
  their initial value (zeros)."""
  drafter = drafters.build("token_recycling", target)
  k = drafter.table.shape[1]
  prompts = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27]]
  out, cache = _prefill_cache(target, prompts, width=16, fill=90)  # row 0 padded with 90 90
  lens = jnp.asarray([6, 8], jnp.int32)
  history = jnp.asarray(_padded(prompts, 16, fill=90))
  prefill = Prefill(history[:, :8], history, lens + 1, None, out.hidden, cache)
  table = np.asarray(drafter.init(_view(target), prefill))
  expect = np.zeros((tt.GREEDY_VOCAB, k), np.int64)
  for prompt in prompts:
    logits = tt.logits_of(target, [prompt])[0]
    for i, tok in enumerate(prompt):
      expect[tok] = _top_k(logits[i], k)
  np.testing.assert_array_equal(table, expect)


def test_token_recycling_update_refreshes_block_rows(target):
  """`update` writes, for each live row, table[block token] = top-k of that block row's logits;
  a finished (dead) row writes nothing; other rows are untouched."""
  drafter = drafters.build("token_recycling", target)
  v, k = drafter.table.shape
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.integers(0, v, (v, k)), jnp.int32)
  block = np.array([[3, 40, 41, 42], [5, 50, 51, 52]], np.int32)
  logits = rng.standard_normal((2, 4, v)).astype(np.float32)
  result = RoundResult(None, None, jnp.asarray(block), jnp.asarray(logits), None,
                       jnp.asarray([True, False]), None, None)
  new = np.asarray(drafter.update(_view(target), table, result))
  expect = np.asarray(table).copy()
  expect[block[0]] = _top_k(logits[0], k)
  np.testing.assert_array_equal(new, expect)


@pytest.mark.parametrize("paths", [token_recycling.DEFAULT_PATHS,
                                   trees.TreeTemplate.full((2, 2, 1)).paths])
def test_token_recycling_draft_fills_template_from_table(target, paths):
  """`draft` fills the template: the node of path (r1, .., rd) gets the token reached from
  `pending` by following table[t, r1], then table[., r2], ... (node = table[parent token, rank]);
  the structure is the template's, all nodes valid, children deterministic (q None)."""
  drafter = drafters.build("token_recycling", target, paths=paths)
  v, k = drafter.table.shape
  rng = np.random.default_rng(1)
  table = np.stack([rng.permutation(v)[:k] for _ in range(v)]).astype(np.int32)
  pending = np.array([5, 17, 5], np.int32)
  ctx = DraftContext(None, None, jnp.asarray(pending), None, None)
  tree, state, _ = drafter.draft(_view(target), jnp.asarray(table), ctx)
  tpl = drafter.template
  for b, root in enumerate(pending):
    for i, path in enumerate(tpl.paths):
      tok = root
      for r in path:
        tok = table[tok, r]
      assert tree.tokens[b, i] == tok, (b, path)
  np.testing.assert_array_equal(tree.parent, np.broadcast_to(tpl.parent, tree.parent.shape))
  np.testing.assert_array_equal(tree.depth, np.broadcast_to(tpl.depth, tree.depth.shape))
  assert np.asarray(tree.valid).all() and tree.draft is None
  np.testing.assert_array_equal(state, table)  # drafting does not change the table


# ------------------------------------------------------------------------------------------------
# layer_skip


CHAIN_WIDTH = 48  # fixed padded width of the reference forward: one compile per model


@functools.partial(jax.jit, static_argnums=(0, 4))
def _last_logits(cfg, params, tokens, length, num_layers):
  """Logits after the first `length` tokens of `tokens: int32[1, CHAIN_WIDTH]`, through the first
  `num_layers` layers (+ final norm + head), without a cache."""
  w = tokens.shape[1]
  out = decoder.forward(cfg, params, tokens, jnp.arange(w)[None], decoder.causal_mask(length, w),
                        None, logits_index=(length - 1)[:, None], num_layers=num_layers)
  return out.logits[0, 0]


def _truncated_chain(model, prefix, steps, num_layers, sampling=GREEDY):
  """Greedy chain of the first `num_layers` layers (+ norm + head), recomputed without a cache
  at each step: (tokens, processed distributions at each step)."""
  seq, dists = list(prefix), []
  for _ in range(steps):
    tokens = jnp.asarray(_padded([seq], CHAIN_WIDTH))
    logits = _last_logits(model.config, model.params, tokens, jnp.asarray([len(seq)]),
                          num_layers)
    dists.append(np.asarray(target_probs(logits, sampling)))
    seq.append(int(jnp.argmax(logits)))
  return seq[len(prefix):], dists


def _layer_skip_context(target, rng_seed=0):
  prompts = [[4, 8, 15, 16, 23, 42, 7], [1, 2, 3]]
  pending = [9, 11]
  _, cache = _prefill_cache(target, prompts, width=24)
  history = jnp.asarray(_padded([p + [x] for p, x in zip(prompts, pending)], 24))
  ctx = DraftContext(history, jnp.asarray([8, 4], jnp.int32), jnp.asarray(pending, jnp.int32),
                     cache, jax.random.key(rng_seed))
  return prompts, pending, ctx


def test_layer_skip_greedy_draft_and_cache_prefix(target):
  """Greedy layer-skip drafts the argmax chain of the truncated model (checked against a
  cache-free forward); the target cache comes back with the same length, its committed prefix
  (slots < length) bit-identical in every layer, and the layers the drafter does not run
  untouched at every slot: rolling back a draft is nothing."""
  drafter = drafters.build("layer_skip", target, num_layers=1, num_tokens=4)
  prompts, pending, ctx = _layer_skip_context(target)
  tree, _, cache = jax.jit(drafter.draft)(_view(target), (), ctx)
  for b, (prompt, x) in enumerate(zip(prompts, pending)):
    expect, _ = _truncated_chain(target, prompt + [x], 4, num_layers=1)
    assert np.asarray(tree.tokens[b]).tolist() == expect
  assert tree.draft is None and np.asarray(tree.valid).all()
  np.testing.assert_array_equal(cache.length, ctx.cache.length)
  old_k, old_v, new_k, new_v = (np.asarray(a) for a in (ctx.cache.k, ctx.cache.v, cache.k,
                                                        cache.v))
  for b, n in enumerate(np.asarray(ctx.cache.length)):
    np.testing.assert_array_equal(new_k[:, b, :n], old_k[:, b, :n])
    np.testing.assert_array_equal(new_v[:, b, :n], old_v[:, b, :n])
  np.testing.assert_array_equal(new_k[1:], old_k[1:])  # layer 1 is never run by the drafter
  np.testing.assert_array_equal(new_v[1:], old_v[1:])


def test_layer_skip_sampled_q_is_the_drafting_distribution(target):
  """At T = 0.7, top-p 0.9, each node's q is the truncated model's processed distribution at that
  node's position given the drafted prefix (recomputed without a cache, 1e-5), and each drafted
  token has q > 0: the q-based rule gets exactly the distribution the token was drawn from."""
  drafter = drafters.build("layer_skip", target, num_layers=1, num_tokens=4)
  prompts, pending, ctx = _layer_skip_context(target, rng_seed=3)
  tree, _, _ = jax.jit(drafter.draft)(_view(target, TOP_P), (), ctx)
  trees.validate(tree)
  q, tokens = np.asarray(tree.node_q(target.config.vocab_size)), np.asarray(tree.tokens)
  for b, (prompt, x) in enumerate(zip(prompts, pending)):
    seq = prompt + [x]
    for i in range(4):
      _, (dist,) = _truncated_chain(target, seq + tokens[b, :i].tolist(), 1, 1, TOP_P)
      np.testing.assert_allclose(q[b, i], dist, atol=1e-5)
      assert q[b, i, tokens[b, i]] > 0


def _batch4_prompts():
  rng = np.random.default_rng(99)
  return [rng.integers(0, tt.GREEDY_VOCAB, n).tolist() for n in (5, 30, 12, 21)]


def test_layer_skip_exact_truncation_accepts_every_draft():
  """With the last layer zeroed, the first L - 1 layers compute the full model exactly: greedy
  layer-skip drafts (num_layers = L - 1) are all accepted, every round (tau = 5 but for the cut
  last round), and the tokens are the autoregressive ones."""
  target = tt.zero_last_layer(tt.greedy_target())
  drafter = drafters.build("layer_skip", target, num_layers=target.config.num_layers - 1,
                           num_tokens=4)
  prompts = _batch4_prompts()
  result = specjax.generate(target, prompts, max_new_tokens=128, drafter=drafter, pad_to=32)
  rounds = -(-127 // 5)
  assert result.stats.accepted_by_depth == (0, 0, 0, 0, 4 * rounds)
  assert result.tokens == specjax.generate(target, prompts, max_new_tokens=128, pad_to=32).tokens


# ------------------------------------------------------------------------------------------------
# draft_lm


def test_draft_lm_cache_follows_partial_acceptance(target):
  """Drive a random draft LM (3-token chains) through rounds that accept 0, some and all of its
  drafts, then emit a bonus: after each `update`, the next `draft` equals the draft LM's greedy
  chain recomputed without a cache on the new history (the 1- and 2-token catch-up paths of its
  cache), and its cache holds every history token except `pending` (and the last accepted
  draft, which it never fed, after a full acceptance)."""
  small = tt.draft_target()
  drafter = draft_lm.build(target, draft=small, num_tokens=3)
  view = _view(target)
  prompts = [[4, 8, 15, 16, 23, 42, 7], [1, 2, 3], [60, 61, 62, 60, 61]]
  first = [9, 11, 13]
  width = 40
  rows = [p + [x] for p, x in zip(prompts, first)]
  prompt_arr = jnp.asarray(_padded(prompts, 7))
  history = jnp.asarray(_padded(rows, width))
  lens = jnp.asarray([len(r) for r in rows], jnp.int32)
  state = drafter.init(view, Prefill(prompt_arr, history, lens, None, None, None))
  draft = jax.jit(drafter.draft)
  bonus = iter(range(70, 96))
  for n_acc in ([0, 3, 1], [3, 2, 0], [2, 0, 3]):
    ctx = DraftContext(jnp.asarray(_padded(rows, width)), jnp.asarray([len(r) for r in rows]),
                       jnp.asarray([r[-1] for r in rows], jnp.int32), None, jax.random.key(0))
    tree, state, _ = draft(view, state, ctx)
    for b, row in enumerate(rows):
      expect, _ = _truncated_chain(small, row, 3, num_layers=1)
      assert np.asarray(tree.tokens[b]).tolist() == expect, (b, n_acc)
    acc = Acceptance(jnp.asarray(n_acc, jnp.int32), None, None, None)
    state = drafter.update(view, state, RoundResult(tree, acc, None, None, None, None, None, None))
    rows = [row + np.asarray(tree.tokens[b, :n]).tolist() + [next(bonus)]
            for b, (row, n) in enumerate(zip(rows, n_acc))]
    unfed = [2 if n == 3 else 1 for n in n_acc]
    assert np.asarray(state.cache.length).tolist() == [len(r) - u for r, u in zip(rows, unfed)]


def test_draft_lm_sampled_q_is_the_drafting_distribution(target):
  """At T = 0.7, top-p 0.9, node i's q is the draft LM's processed distribution after the
  history and the first i drafted tokens (cache-free recomputation, 1e-5); drafted tokens have
  q > 0."""
  small = tt.draft_target()
  drafter = draft_lm.build(target, draft=small, num_tokens=3)
  view = _view(target, TOP_P)
  prompts, first = [[4, 8, 15, 16, 23, 42, 7], [1, 2, 3]], [9, 11]
  rows = [p + [x] for p, x in zip(prompts, first)]
  history = jnp.asarray(_padded(rows, 24))
  lens = jnp.asarray([len(r) for r in rows], jnp.int32)
  state = drafter.init(view, Prefill(jnp.asarray(_padded(prompts, 7)), history, lens, None, None,
                                     None))
  ctx = DraftContext(history, lens, jnp.asarray(first, jnp.int32), None, jax.random.key(5))
  tree, _, _ = jax.jit(drafter.draft)(view, state, ctx)
  trees.validate(tree)
  q, tokens = np.asarray(tree.node_q(target.config.vocab_size)), np.asarray(tree.tokens)
  for b, row in enumerate(rows):
    for i in range(3):
      _, (dist,) = _truncated_chain(small, row + tokens[b, :i].tolist(), 1, 1, TOP_P)
      np.testing.assert_allclose(q[b, i], dist, atol=1e-5)
      assert q[b, i, tokens[b, i]] > 0


@pytest.fixture(scope="module")
def self_draft(target):
  return draft_lm.build(target, draft=target, num_tokens=5)


def test_draft_lm_self_cache_in_sync_after_generate(target, self_draft):
  """draft = the target (5 tokens), greedy, 128 tokens, batch 4: every round accepts all 5
  drafts; the draft cache ends holding prompt + 131 tokens (all but the last accepted draft and
  the bonus), and its keys and values equal a fresh prefill of the same tokens (1e-4): no round
  left a stale or shifted entry behind."""
  prompts = _batch4_prompts()
  result = specjax.generate(target, prompts, max_new_tokens=128, drafter=self_draft, pad_to=32)
  assert result.stats.accepted_by_depth == (0,) * 5 + (4 * 22,)
  cache = result.drafter_state.cache
  assert np.asarray(cache.length).tolist() == [len(p) + 131 for p in prompts]
  seqs = [prompt + new for prompt, new in zip(prompts, result.tokens)]
  _, fresh = _prefill_cache(target, seqs, width=max(map(len, seqs)))
  for b, seq in enumerate(seqs):
    n = len(seq)
    for got, want in zip(cache.stacked(), fresh.stacked()):  # k, then v: [L, B, S, K, D]
      np.testing.assert_allclose(np.asarray(got[:, b, :n]), np.asarray(want[:, b, :n]),
                                 rtol=1e-4, atol=1e-4)


def test_draft_lm_self_accepts_everything_when_sampling(target, self_draft):
  """T = 1 over 128 tokens: q and p are the same model's distribution, so each draft is accepted
  with probability 1 in every round: a draft cache that drifted from the target's history in a
  later round would show up as a rejection."""
  result = specjax.generate(target, _batch4_prompts(), max_new_tokens=128, drafter=self_draft,
                            pad_to=32, temperature=1.0, seed=7)
  assert result.stats.accepted_by_depth == (0,) * 5 + (4 * 22,)


def _word_tokenizer(words):
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  return tok


def test_draft_lm_check_compatible(target):
  """check_compatible: a different vocab size or a different tokenizer raises ValueError naming
  it; the same tokenizer, or a missing one on either side, passes."""
  words = [f"w{i}" for i in range(tt.GREEDY_VOCAB)]
  tok_a, tok_b = _word_tokenizer(words), _word_tokenizer(words[::-1])
  small = tt.draft_target()
  other_vocab = tt.scaled_target(tt.config(50, num_layers=1), seed=2)
  with pytest.raises(ValueError, match="vocab_size 50 != target vocab_size 96"):
    draft_lm.check_compatible(other_vocab, target)
  with pytest.raises(ValueError, match="tokenizer differs"):
    draft_lm.check_compatible(small.replace(tokenizer=tok_b), target.replace(tokenizer=tok_a))
  draft_lm.check_compatible(small.replace(tokenizer=_word_tokenizer(words)),
                            target.replace(tokenizer=tok_a))
  draft_lm.check_compatible(small, target.replace(tokenizer=tok_a))
  with pytest.raises(ValueError, match=r"draft_lm num_tokens must be in \[1, 256\], got 0"):
    draft_lm.build(target, draft=small, num_tokens=0)


# ------------------------------------------------------------------------------------------------
# oracle


def test_oracle_drafts_the_reference_continuation():
  """The oracle proposes the next num_tokens tokens of its reference after what each row has
  emitted (pending included); nodes past the reference are invalid."""
  reference = jnp.asarray([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]], jnp.int32)
  oracle = Oracle(reference, jnp.asarray([3, 5], jnp.int32), num_tokens=3)
  ctx = DraftContext(None, jnp.asarray([3 + 1, 5 + 4], jnp.int32), None, None, None)
  tree, _, _ = oracle.draft(None, (), ctx)
  assert np.asarray(tree.tokens[0]).tolist() == [11, 12, 13]
  assert np.asarray(tree.tokens[1, :2]).tolist() == [24, 25]
  assert np.asarray(tree.valid).tolist() == [[True] * 3, [True, True, False]]


# ------------------------------------------------------------------------------------------------
# registry


def test_registry_available_lists_only_usable_drafters(target):
  """A random 2-layer target without tokenizer can run the n-gram model, prompt lookup, Token
  Recycling and layer-skip, but not draft_lm (no compatible shipped draft LM); a 1-layer target
  cannot skip layers. Every available name builds."""
  assert set(drafters.names()) >= {"draft_lm", "layer_skip", "ngram", "prompt_lookup",
                                   "token_recycling"}
  assert drafters.available(target) == ["layer_skip", "ngram", "prompt_lookup",
                                        "token_recycling"]
  one_layer = tt.draft_target()
  assert drafters.available(one_layer) == ["ngram", "prompt_lookup", "token_recycling"]
  for name in drafters.available(target):
    assert drafters.build(name, target).num_nodes > 0
    assert drafters.describe(name)


@pytest.mark.parametrize("name,target_kind,message", [
    # No compatible draft LM: the shipped one has another vocabulary (or is not there yet).
    ("draft_lm", "two_layers", r"vocab_size 8192 != target vocab_size|does not exist"),
    ("layer_skip", "one_layer", r"layer_skip needs a target with at least 2 layers"),
    ("no_such_drafter", "two_layers", r"unknown drafter 'no_such_drafter'; registered: \["),
])
def test_registry_build_rejects_unusable_or_unknown(target, name, target_kind, message):
  """build() raises the builder's own clear error for a target it cannot serve."""
  t = target if target_kind == "two_layers" else tt.draft_target()
  with pytest.raises(ValueError, match=message):
    drafters.build(name, t)


@pytest.mark.parametrize("name,options,message", [
    ("layer_skip", dict(num_layers=2), r"num_layers must be in \[1, 1\]"),
    ("layer_skip", dict(num_tokens=0), r"layer_skip num_tokens must be in \[1, 256\], got 0"),
    ("prompt_lookup", dict(min_ngram=3, max_ngram=2), r"min_ngram <= max_ngram"),
    ("prompt_lookup", dict(num_branches=0), r"num_branches must be in \[1, 85\], got 0"),
    ("ngram", dict(min_ngram=3, max_ngram=2), r"min_ngram <= max_ngram"),
    ("ngram", dict(match_scale=0), r"ngram match_scale must be > 0 \(or None: fixed length\)"),
    ("ngram", dict(verify_sizes=(0, 8)), r"ngram verify_sizes entry must be in \[0, 7\], got 8"),
    ("ngram", dict(verify_sizes=3), r"ngram verify_sizes must be a list of ints, got 3"),
    ("token_recycling", dict(k=1), r"k=1 is smaller than the template's largest rank"),
])
def test_registry_build_rejects_bad_options(target, name, options, message):
  with pytest.raises(ValueError, match=message):
    drafters.build(name, target, **options)
