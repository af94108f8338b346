"""Learned drafters (Medusa, Hydra, EAGLE, EAGLE-3, DFlash): their bookkeeping, trees, files
and the shipped checkpoints.

  1. EAGLE-2's dynamic tree against a brute-force enumeration: the kept nodes are the top-N of
     all candidates by cumulative log-probability, parents precede children, shapes are static.
  2. The drafters' state follows decoding: after real rounds, the feature Medusa/Hydra read is
     the target's hidden state of the last committed position, and EAGLE's first two tree levels
     equal a cache-free run of its training-time-test unroll over the same history (what the
     drafter was trained on is what it does at inference: positions, masks, fed pairs).
  3. Drafter folders: a save/load round trip, and clear errors for a target of another
     vocabulary, hidden size or tokenizer, missing or corrupt files, unknown methods.
  4. The shipped drafters are available for the embedded target, load at its compute dtype
     (float32 for its bfloat16 weights), accept (tau > 1.5) and are lossless: greedy tokens
     identical to autoregressive decoding at batch 1 and 4.
  (Greedy and sampling losslessness on tiny targets: tests/test_speculative.py.)
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import assets, decoding, drafters, sharding, trees
from specjax import rounds as core
from specjax.drafters import eagle_common, io, learned, medusa
from specjax.drafters.base import DraftContext, TargetView
from specjax.models import decoder
from specjax.sampling import SamplingConfig
from tests.helpers import tiny_targets as tt

LEARNED = ("medusa", "hydra", "eagle", "eagle3", "dflash")


# ------------------------------------------------------------------------------------------------
# 1. The dynamic tree


def _brute_force(root_logp, tables, depth, k):
  """All candidates of EAGLE-2's expansion, enumerated in plain Python: (score, path) pairs."""
  cands = []
  order = np.argsort(-root_logp, kind="stable")[:k]
  frontier = [((int(t),), float(root_logp[t])) for t in order]
  cands += frontier
  for level in range(1, depth):
    children = []
    for path, score in frontier:
      lp = tables[level][path[-1]]
      for t in np.argsort(-lp, kind="stable")[:k]:
        children.append((path + (int(t),), score + float(lp[t])))
    cands += children
    frontier = sorted(children, key=lambda c: -c[1])[:k]
  return cands


@pytest.mark.parametrize("depth,k,n", [(1, 3, 2), (3, 2, 7), (4, 3, 12), (5, 4, 30)])
def test_dynamic_tree_keeps_top_n_by_cumulative_logprob(depth, k, n):
  """A fake drafter whose children's log-probabilities depend on the level and the parent token:
  the tree keeps exactly the N best candidates, each node's score is its parent's plus its own
  log-probability, and the path of every node exists in the tree (parents precede children)."""
  v = 11
  rng = np.random.default_rng(depth * 100 + k)
  root = jax.nn.log_softmax(jnp.asarray(rng.normal(size=v) * 2, jnp.float32))
  tables = [None] + [np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(v, v)) * 2,
                                                               jnp.float32)))
                     for _ in range(depth - 1)]

  def expand(carry, tokens, parent, level):
    return jnp.asarray(tables[level])[tokens], carry

  grown, _ = jax.jit(lambda r: trees.grow_dynamic_tree(
      r, expand, (), depth=depth, top_k=k, num_nodes=n))(root[None])
  tree = grown.tree
  assert tree.tokens.shape == tree.parent.shape == grown.score.shape == (1, n)  # static
  trees.validate(tree, v)  # parents precede children, depths consistent
  paths, scores = [], np.asarray(grown.score[0])
  for i in range(n):
    par = int(tree.parent[0, i])
    paths.append((paths[par] if par >= 0 else ()) + (int(tree.tokens[0, i]),))
    lp = np.asarray(root)[paths[i][-1]] if par < 0 else tables[len(paths[i]) - 1][
        paths[par][-1]][paths[i][-1]]
    assert scores[i] == pytest.approx((scores[par] if par >= 0 else 0.0) + lp, abs=1e-5)
  cands = _brute_force(np.asarray(root), tables, depth, k)
  best = sorted(c[1] for c in cands)[::-1][:n]
  np.testing.assert_allclose(sorted(scores)[::-1], best, atol=1e-5)
  assert set(paths) <= {c[0] for c in cands} and len(set(paths)) == n


def test_dynamic_tree_rejects_impossible_size():
  with pytest.raises(ValueError, match="num_nodes must be in"):
    trees.grow_dynamic_tree(jnp.zeros((1, 5)), None, (), depth=2, top_k=2, num_nodes=7)


# ------------------------------------------------------------------------------------------------
# 2. Drafter state follows decoding


@pytest.fixture(scope="module")
def target():
  return tt.greedy_target()


PROMPT = [5, 17, 3, 88, 41, 3, 17, 9, 60, 2, 71, 33]


def _rounds(target, drafter, rounds: int, prompts=(PROMPT,)):
  """Prefill + `rounds` speculative rounds through decoding's own phases (a ragged batch when
  `prompts` holds several)."""
  run = decoding.prepare(target, list(prompts), 48, drafter, SamplingConfig(), 0, [], 16)
  state = jax.jit(core.prefill, static_argnums=0)(run.spec, run.args, run.fresh_cache())
  loop = core.Loop.of(run.spec, run.args)
  step = jax.jit(core.run_round)
  for _ in range(rounds):
    state = step(loop, state)
  return state


def _hidden(target, tokens, layers):
  out = decoder.full_forward(target.config, target.params, jnp.asarray([tokens], jnp.int32),
                             hidden_layers=layers)
  return out.hidden


@pytest.mark.parametrize("method", ["medusa", "hydra"])
@pytest.mark.parametrize("rounds", [0, 3])
def test_head_drafters_read_the_last_committed_hidden_state(target, method, rounds):
  drafter = tt.learned_drafter(method, target)
  state = _rounds(target, drafter, rounds)
  n = int(state.hist_len[0])
  history = np.asarray(state.history[0, :n]).tolist()
  want = _hidden(target, history[:-1], drafter.hidden_layers)[0, 0, -1]
  np.testing.assert_allclose(state.drafter_state.feature[0], want, atol=1e-4, rtol=1e-4)


def test_medusa_tree_takes_each_heads_ranked_candidates(target):
  """Node (r_1, .., r_d) of the template holds the rank-r_d token of head d."""
  drafter = tt.learned_drafter("medusa", target)
  state = _rounds(target, drafter, 2)
  view = TargetView(target.config, SamplingConfig(), target.params)
  ctx = DraftContext(state.history, state.hist_len, state.pending, state.cache,
                     jax.random.key(0))
  tree, _, _ = drafter.draft(view, state.drafter_state, ctx)
  heads = learned.merge(medusa.MedusaHeads, drafter.net, drafter.params)
  logits = np.asarray(heads(state.drafter_state.feature) @ drafter.head)[0]  # [K, V]
  for i, path in enumerate(drafter.template.paths):
    d, r = len(path), path[-1]
    assert int(tree.tokens[0, i]) == int(np.argsort(-logits[d - 1], kind="stable")[r])


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("rounds", [0, 4])
def test_eagle_tree_matches_the_training_unroll(target, method, rounds):
  """After prefill and real rounds (partial acceptances), the drafter's cache holds exactly the
  pairs of the committed history, so its depth-1 candidates equal the top-k of step 0 of
  `eagle_common.unroll` over the history (cache-free, target features recomputed), and the
  children of the best depth-1 node equal the top-k of unroll step 1 at the same index, the
  training-time-test view of a depth-2 node."""
  drafter = tt.learned_drafter(method, target, depth=3, top_k=4, total_tokens=12)
  state = _rounds(target, drafter, rounds)
  ds = state.drafter_state
  n = int(state.hist_len[0])
  assert int(ds.cache.length[0]) + int(ds.n_new[0]) == n - 1
  view = TargetView(target.config, SamplingConfig(), target.params)
  ctx = DraftContext(state.history, state.hist_len, state.pending, state.cache,
                     jax.random.key(0))
  tree, _, _ = drafter.draft(view, ds, ctx)
  tokens, parent, depth = (np.asarray(x[0]) for x in (tree.tokens, tree.parent, tree.depth))
  top = int(tokens[0])  # node 0: the best depth-1 candidate
  history = np.asarray(state.history[0, :n]).tolist() + [top]
  feats = learned.concat_features(_hidden(target, history, drafter.hidden_layers))
  emb = learned.target_embedding(target.config, target.params)
  net = learned.merge(drafter.module, drafter.net, drafter.params)
  logits, _ = eagle_common.unroll(net, feats, jnp.asarray([history]), emb, drafter.head, 2)
  ref1 = np.argsort(-np.asarray(logits[0, 0, n - 2]), kind="stable")[:4]
  ref2 = np.argsort(-np.asarray(logits[1, 0, n - 2]), kind="stable")[:4]
  level1 = tokens[(depth == 1)]
  assert top == ref1[0] and set(level1.tolist()) <= set(ref1.tolist())
  children = tokens[(parent == 0)]
  assert children.size and set(children.tolist()) <= set(ref2.tolist())
  assert children[0] == ref2[0]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_recent_tokens_extend_the_draft_vocabulary(target, method):
  """With `recent_tokens`, the history's last R tokens that the draft vocabulary lacks become
  extra draft ids for the round (each once, its most recent occurrence), scored by the target's
  LM head columns on what the draft head reads (EAGLE: exactly what a full-vocabulary EAGLE
  scores); slots for tokens already in the vocabulary, repeats, or positions before the text
  score -inf, and siblings in the tree stay distinct target ids."""
  small = np.asarray([i for i in range(target.config.vocab_size)
                      if i % 2 == 0 and i not in PROMPT], np.int32)  # every PROMPT id is missing
  r = 16
  reduced = tt.learned_drafter(method, target, d2t=small, depth=3, top_k=4, total_tokens=12,
                               recent_tokens=r)
  state = _rounds(target, reduced, 2)
  view = TargetView(target.config, SamplingConfig(), target.params)
  ctx = DraftContext(state.history, state.hist_len, state.pending, state.cache,
                     jax.random.key(0))
  recent = reduced.recent_vocab(view, ctx)
  n = int(state.hist_len[0])
  pos = n - r + np.arange(r)  # may start before the text after few rounds
  last = np.asarray(state.history[0])[np.maximum(pos, 0)]
  ids, live = np.asarray(recent.ids[0]), np.asarray(recent.live[0])
  np.testing.assert_array_equal(ids, last)
  want_live = [p >= 0 and x not in small and x not in last[j + 1:]
               for j, (p, x) in enumerate(zip(pos, last.tolist()))]
  np.testing.assert_array_equal(live, want_live)
  assert live.any() and not live.all()

  net = learned.merge(reduced.module, reduced.net, reduced.params)
  h = jax.random.normal(jax.random.key(1), (1, 3, target.config.hidden_size))
  got = np.asarray(reduced._logits(net, h, recent))  # [1, 3, Vd + r]
  tid = np.asarray(reduced.to_target_ids(jnp.arange(small.size + r)[None, None, :], recent))[0, 0]
  np.testing.assert_array_equal(tid[:small.size], small)
  np.testing.assert_array_equal(tid[small.size:], ids)
  np.testing.assert_allclose(got[..., :small.size], np.asarray(net.logits(h, reduced.head)),
                             rtol=1e-6, atol=1e-6)
  unembedding = np.asarray(decoder.unembedding(target.config, target.params))
  extra = np.asarray(net.head_input(h)) @ unembedding[:, ids]
  np.testing.assert_allclose(got[..., small.size:][..., live], extra[..., live], rtol=1e-5,
                             atol=1e-5)
  assert np.all(got[..., small.size:][..., ~live] == -np.inf)
  if method == "eagle":  # the target's head: a full-vocabulary EAGLE scores the same
    full = reduced.replace(d2t=jnp.arange(target.config.vocab_size),
                           head=jnp.asarray(unembedding), recent_tokens=0)
    ok = np.concatenate([np.ones(small.size, bool), live])
    np.testing.assert_allclose(got[..., ok], np.asarray(full._logits(net, h, None))[..., tid[ok]],
                               rtol=1e-5, atol=1e-5)

  tree, _, _ = reduced.draft(view, state.drafter_state, ctx)
  tokens, parent = np.asarray(tree.tokens[0]), np.asarray(tree.parent[0])
  assert set(tokens.tolist()) <= set(small.tolist()) | set(ids[live].tolist())
  for p in set(parent.tolist()):
    siblings = tokens[parent == p]
    assert len(set(siblings.tolist())) == siblings.size


@pytest.mark.parametrize("method", ["medusa", "hydra"])
def test_static_trees_rank_recent_tokens_with_the_draft_vocabulary(target, method):
  """Medusa and Hydra with `recent_tokens`: every node holds the token its head ranks at the
  node's rank over the draft vocabulary plus the round's live extra ids (scored by the target's
  head columns, the head they share), so extra ids are proposed where they rank."""
  small = np.asarray([i for i in range(target.config.vocab_size)
                      if i % 2 == 0 and i not in PROMPT], np.int32)
  r = 16
  drafter = tt.learned_drafter(method, target, d2t=small, recent_tokens=r)
  state = _rounds(target, drafter, 2)
  view = TargetView(target.config, SamplingConfig(), target.params)
  ctx = DraftContext(state.history, state.hist_len, state.pending, state.cache,
                     jax.random.key(0))
  tree, _, _ = drafter.draft(view, state.drafter_state, ctx)
  recent = drafter.recent_vocab(view, ctx)
  ids, live = np.asarray(recent.ids[0]), np.asarray(recent.live[0])
  tokens = np.asarray(tree.tokens[0])
  unembedding = np.asarray(decoder.unembedding(target.config, target.params))
  allowed = np.concatenate([small, ids[live]])
  if method == "medusa":
    heads = learned.merge(medusa.MedusaHeads, drafter.net, drafter.params)
    h = np.asarray(heads(state.drafter_state.feature))[0]  # [K, E]
    logits = h @ unembedding[:, allowed]  # [K, allowed]
    for i, path in enumerate(drafter.template.paths):
      d, rank = len(path), path[-1]
      assert int(tokens[i]) == int(allowed[np.argsort(-logits[d - 1], kind="stable")[rank]])
  assert set(tokens.tolist()) <= set(allowed.tolist())
  parent = np.asarray(tree.parent[0])
  for p in set(parent.tolist()):
    assert len(set(tokens[parent == p].tolist())) == int((parent == p).sum())


@pytest.mark.parametrize("method", LEARNED)
def test_recent_tokens_must_not_be_negative(target, method):
  with pytest.raises(ValueError, match="recent_tokens must be >= 0"):
    tt.learned_drafter(method, target, recent_tokens=-1)


# ------------------------------------------------------------------------------------------------
# 3. Drafter folders


@pytest.mark.parametrize("method", LEARNED)
def test_save_load_round_trip(target, method, tmp_path):
  drafter = tt.learned_drafter(method, target, seed=3)
  io.save_drafter(tmp_path, method, drafter.net, drafter.params, drafter.d2t, target.config,
                  metadata={"note": "test"})
  loaded = io.load_drafter(tmp_path, target)
  assert type(loaded) is type(drafter) and loaded.num_nodes == drafter.num_nodes
  for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(loaded.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(loaded.d2t, drafter.d2t)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["method"] == method and config["hidden_layers"] == list(drafter.hidden_layers)


@pytest.fixture()
def saved(target, tmp_path):
  drafter = tt.learned_drafter("eagle3", target)
  io.save_drafter(tmp_path, "eagle3", drafter.net, drafter.params, drafter.d2t, target.config)
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


def test_load_refuses_another_tokenizer(saved, target):
  """Same shapes, other token ids: the check that pairs a drafter with its target's tokenizer."""
  shipped = specjax.load_target(assets.TARGET_DIR)
  config = json.loads((saved / "config.json").read_text())
  config["target"].update({k: getattr(shipped.config, k)
                           for k in ("vocab_size", "hidden_size", "num_layers")})
  config["target"]["tokenizer_sha256"] = "0" * 64
  with pytest.raises(ValueError, match="another tokenizer"):
    io.check_target(config, shipped, saved)


def test_load_names_missing_and_corrupt_files(saved, target, tmp_path_factory):
  with pytest.raises(ValueError, match="config.json is missing"):
    io.load_drafter(tmp_path_factory.mktemp("empty"), target)
  weights = saved / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match="corrupt drafter weights"):
    io.load_drafter(saved, target)
  weights.unlink()
  with pytest.raises(ValueError, match="drafter weights missing"):
    io.load_drafter(saved, target)
  (saved / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="corrupt drafter config"):
    io.load_drafter(saved, target)


def test_load_rejects_unknown_method_and_bad_tree_options(saved, target):
  with pytest.raises(ValueError, match="total_tokens must be in"):
    io.load_drafter(saved, target, depth=2, top_k=2, total_tokens=7)
  config = json.loads((saved / "config.json").read_text())
  config["method"] = "medusa9"
  (saved / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="unknown learned drafter method 'medusa9'"):
    io.load_drafter(saved, target)


def test_medusa_tree_deeper_than_its_heads_is_rejected(target, tmp_path):
  drafter = tt.learned_drafter("medusa", target)
  io.save_drafter(tmp_path, "medusa", drafter.net, drafter.params, drafter.d2t, target.config)
  with pytest.raises(ValueError, match="exceeds the drafter's 4 heads"):
    io.load_drafter(tmp_path, target, choices=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0],
                                               [0, 0, 0, 0, 0]])


# ------------------------------------------------------------------------------------------------
# 4. The shipped drafters


@pytest.fixture(scope="module")
def embedded():
  return specjax.load_target(assets.TARGET_DIR, dtype="float32")


def _code_prompts():
  return ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
          "import os\n\n\ndef list_python_files(root):\n",
          "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self",
          "def is_palindrome(s: str) -> bool:\n"]


def test_shipped_drafters_are_available(embedded):
  assert set(LEARNED) <= set(drafters.available(embedded))
  for method in LEARNED:
    meta = json.loads(open(os.path.join(io.asset_dir(method), "metadata.json")).read())
    assert meta["steps"] > 0 and len(meta["heldout_agreement_by_depth"]) >= 4


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_drafters_compute_in_the_targets_compute_dtype(compute_dtype):
  """The shipped target stores bfloat16: computing in float32 (the default), its drafters load
  in float32, not at the files' or the target's storage dtype (bfloat16 arithmetic on a CPU
  converts at every op); computing in bfloat16, they do too."""
  target = specjax.load_target(assets.TARGET_DIR, compute_dtype=compute_dtype)
  assert target.config.dtype == "bfloat16"
  assert learned.drafter_dtype(target.config) == compute_dtype
  for method in LEARNED:
    drafter = drafters.build(method, target)
    dtypes = {str(x.dtype) for x in jax.tree.leaves((drafter.params, drafter.head))}
    assert drafter.net.dtype == compute_dtype and dtypes == {compute_dtype}, (method, dtypes)


@pytest.fixture(scope="module")
def embedded_ar(embedded):
  return specjax.generate(embedded, _code_prompts(), max_new_tokens=64, pad_to=32).tokens


@pytest.mark.parametrize("method", LEARNED)
def test_shipped_drafters_are_lossless_and_accept(embedded, embedded_ar, method):
  """Greedy output identical to autoregressive decoding, at batch 4 and batch 1, with real
  acceptance (tau > 1.5: accepted paths of several depths and the drafter-state updates after
  them are exercised)."""
  drafter = drafters.build(method, embedded)
  batch = specjax.generate(embedded, _code_prompts(), max_new_tokens=64, pad_to=32,
                           drafter=drafter)
  assert batch.tokens == embedded_ar
  assert batch.stats.tau > 1.5, batch.stats
  single = specjax.generate(embedded, _code_prompts()[:1], max_new_tokens=64, pad_to=32,
                            drafter=drafter)
  assert single.tokens[0] == embedded_ar[0]


# ------------------------------------------------------------------------------------------------
# 5. A shorter draft vocabulary


def _leaves(params):
  return {sharding.path_str(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("method", LEARNED)
def test_a_shorter_draft_vocabulary_is_the_prefix(embedded, embedded_ar, method):
  """`draft_vocab=k` drafts over the first k ids of the shipped (most frequent first)
  vocabulary: its d2t and head are the whole drafter's first k (the target's columns, or
  EAGLE-3's own head's), every other weight is the same, and greedy output is still
  autoregressive decoding's."""
  whole = drafters.build(method, embedded, draft_vocab=2048)  # the shipped folders' size
  short = drafters.build(method, embedded, draft_vocab=512)
  np.testing.assert_array_equal(short.d2t, np.asarray(whole.d2t)[:512])
  if whole.head is None:
    assert short.head is None
  else:
    np.testing.assert_array_equal(short.head, np.asarray(whole.head)[:, :512])
  a, b = _leaves(whole.params), _leaves(short.params)
  assert a.keys() == b.keys()
  for name in a:
    want = a[name][..., :512] if a[name].shape != b[name].shape else a[name]
    np.testing.assert_array_equal(b[name], want, err_msg=name)
  assert any(a[n].shape != b[n].shape for n in a) == (method == "eagle3")
  out = specjax.generate(embedded, _code_prompts(), max_new_tokens=64, pad_to=32, drafter=short)
  assert out.tokens == embedded_ar
  assert out.stats.tau > 1.5, out.stats


def test_draft_vocab_errors_and_recorded_default(embedded, target, saved, tmp_path):
  """Out of range or not an int: errors naming the option. A vocabulary in id order (a
  published layout's, or this untrained one's) has no most-frequent prefix: an error. A
  folder's recorded default applies, and an explicit option overrides it."""
  for bad in (0, 4096, 2.5):
    with pytest.raises(ValueError, match="draft_vocab must be"):
      drafters.build("eagle", embedded, draft_vocab=bad)
  with pytest.raises(ValueError, match="id order"):
    io.load_drafter(saved, target, draft_vocab=4)
  assert io.load_drafter(saved, target, draft_vocab=tt.GREEDY_VOCAB).d2t.shape == (
      tt.GREEDY_VOCAB,)  # the whole vocabulary: nothing to cut
  folder = tmp_path / "eagle"
  shutil.copytree(io.asset_dir("eagle"), folder)
  io.set_default_tree(folder, **{**io.read_config(folder)["tree"], "draft_vocab": 256})
  assert io.load_drafter(folder, embedded).d2t.shape == (256,)
  assert io.load_drafter(folder, embedded, draft_vocab=1024).d2t.shape == (1024,)
