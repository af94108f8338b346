"""Speculative `generate` is lossless: the end-to-end contract, for every registered drafter.

What is checked:
  1. greedy: every drafter (chains and trees, batch 1 and 4, 50 prompts x 128 new tokens each)
     emits exactly the autoregressive greedy tokens (float ties of the target's top-2 excepted);
     the stats agree with the tokens (tau, accepted_by_depth);
  2. sampling: the exact joint law of the first 3 tokens (x1 from the prefill, x2 and x3 from the
     speculative rounds, bonus tokens included) is enumerated from the target's forward over all
     V^2 prefixes and compared with 12288-24576 sampled rows (as many as the test's power needs)
     by a Pearson chi-square test, for the q-based chain rule, the recursive tree rule and the
     drafter-less baseline;
  3. bad input and the edges of a round: vocab mismatch, unknown names, max_new_tokens or EOS in
     the middle of an accepted path, rows of a batch that stop early;
  4. `pad_to`.

Compile time dominates on CPU: the targets are module-level configs from
tests/helpers/tiny_targets.py, drafters are built once per module, and calls share batch sizes,
`pad_to` and `max_new_tokens` so that `generate`'s cache of compiled programs is reused across
tests.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import specjax
from specjax import decoding, drafters
from specjax.drafters import draft_lm
from specjax.sampling import SamplingConfig, target_probs
from specjax.trees import TreeTemplate
from tests.helpers import tiny_targets as tt
from tests.helpers.exact_law import (
    FULL_BATTERY,
    SAMPLING_PROMPT,
    SAMPLINGS,
    check_exact_law,
)

NEW = 128  # greedy tokens per prompt
PAD = 32  # every greedy prompt is <= 30 tokens: one padding, one program per (drafter, batch)
N_PROMPTS = 50
BATCH1_PROMPTS = 10  # prompts [0, 10) run one by one, [10, 50) in batches of 4
TIE_GAP = 1e-4  # whole-model f32 tolerance: top-2 logits closer than this are a float tie


def _prompts() -> list[list[int]]:
  """50 prompts of 3..30 tokens: even ones uniformly random, odd ones a short random motif
  repeated after a random prefix (so that prompt lookup finds n-gram matches at once)."""
  rng = np.random.default_rng(1234)
  out = []
  for i in range(N_PROMPTS):
    if i % 2 == 0:
      out.append(rng.integers(0, tt.GREEDY_VOCAB, int(rng.integers(3, 31))).tolist())
    else:
      motif = rng.integers(0, tt.GREEDY_VOCAB, int(rng.integers(2, 7))).tolist()
      prefix = rng.integers(0, tt.GREEDY_VOCAB, int(rng.integers(0, 6))).tolist()
      total = int(rng.integers(12, 31))
      out.append((prefix + motif * 30)[:total])
  return out


PROMPTS = _prompts()


def _groups(batch: int) -> list[list[int]]:
  """Prompt indices per call: [0, 10) one by one for batch 1, [10, 50) by 4 for batch 4."""
  if batch == 1:
    return [[i] for i in range(BATCH1_PROMPTS)]
  return [list(range(i, i + 4)) for i in range(BATCH1_PROMPTS, N_PROMPTS, 4)]


@pytest.fixture(scope="module")
def target():
  return tt.greedy_target()


# name -> (registered family, builder). Chains and trees of every registered family.
_GREEDY_DRAFTERS = {
    "prompt_lookup_chain": ("prompt_lookup",
                            lambda t: drafters.build("prompt_lookup", t, num_branches=1)),
    "prompt_lookup_tree": ("prompt_lookup",
                           lambda t: drafters.build("prompt_lookup", t, num_branches=3)),
    # The n-gram model: its default (drafts as long as the history's match, verified at 0, 3 or
    # 7 nodes) and a fixed length verified whole (every size: test_verify_sizes_...).
    "ngram": ("ngram", lambda t: drafters.build("ngram", t)),
    "ngram_fixed": ("ngram", lambda t: drafters.build("ngram", t, num_tokens=4, match_scale=None,
                                                      verify_sizes=())),
    "token_recycling_tree": ("token_recycling", lambda t: drafters.build("token_recycling", t)),
    "token_recycling_chain": ("token_recycling", lambda t: drafters.build(
        "token_recycling", t, paths=TreeTemplate.chain(4).paths)),
    "layer_skip": ("layer_skip", lambda t: drafters.build("layer_skip", t, num_layers=1)),
    # draft_lm is not `available` for a random target (no shipped draft LM), so it is built
    # through its module with an explicit draft.
    "draft_lm_small": ("draft_lm", lambda t: draft_lm.build(t, draft=tt.draft_target(),
                                                            num_tokens=4)),
    "draft_lm_self": ("draft_lm", lambda t: draft_lm.build(t, draft=t, num_tokens=5)),
    # Learned drafters are `available` only with shipped weights for their target: random ones
    # here (tests/drafters/test_learned.py runs the trained ones on the embedded target).
    "medusa": ("medusa", lambda t: tt.learned_drafter("medusa", t)),
    "hydra": ("hydra", lambda t: tt.learned_drafter("hydra", t)),
    # A quarter of the vocabulary, plus the history's recent tokens as extra draft ids.
    "medusa_recent": ("medusa", lambda t: tt.learned_drafter(
        "medusa", t, d2t=np.arange(0, t.config.vocab_size, 4), recent_tokens=12)),
    "hydra_recent": ("hydra", lambda t: tt.learned_drafter(
        "hydra", t, d2t=np.arange(0, t.config.vocab_size, 4), recent_tokens=12)),
    "eagle": ("eagle", lambda t: tt.learned_drafter("eagle", t)),
    "eagle_recent": ("eagle", lambda t: tt.learned_drafter(
        "eagle", t, d2t=np.arange(0, t.config.vocab_size, 4), recent_tokens=12)),
    "eagle3_wide": ("eagle3", lambda t: tt.learned_drafter("eagle3", t, depth=4, top_k=6,
                                                           total_tokens=24)),
    "eagle3_recent": ("eagle3", lambda t: tt.learned_drafter(
        "eagle3", t, d2t=np.arange(0, t.config.vocab_size, 4), recent_tokens=12)),
    # DFlash: the chain over the whole block (7 nodes), a best-first tree from the block's
    # marginals, and a quarter of the vocabulary plus recent tokens.
    "dflash_chain": ("dflash", lambda t: tt.learned_drafter("dflash", t)),
    "dflash_tree": ("dflash", lambda t: tt.learned_drafter("dflash", t, top_k=4,
                                                           total_tokens=16)),
    "dflash_recent": ("dflash", lambda t: tt.learned_drafter(
        "dflash", t, d2t=np.arange(0, t.config.vocab_size, 4), recent_tokens=12)),
}


@pytest.fixture(scope="module")
def greedy_drafters(target):
  return {name: build(target) for name, (_, build) in _GREEDY_DRAFTERS.items()}


@pytest.fixture(scope="module")
def ar(target):
  """Autoregressive greedy tokens (drafter=None) of every prompt, each run alone (batch 1), and
  of prompts [10, 50) run in batches of 4."""
  alone = [specjax.generate(target, [p], max_new_tokens=NEW, pad_to=PAD).tokens[0]
           for p in PROMPTS]
  batched, stats = {}, []
  for group in _groups(4):
    result = specjax.generate(target, [PROMPTS[i] for i in group], max_new_tokens=NEW,
                              pad_to=PAD)
    batched.update(zip(group, result.tokens))
    stats.append(result.stats)
  return alone, batched, stats


def _assert_greedy_equal(target, prompt, ours, ref, where) -> bool:
  """Token-for-token equality, with one narrow exception: at the first
  mismatch, ours may be the runner-up if the target's top-2 logits there differ by < TIE_GAP
  (the verification block and the one-token step round differently); the sequences then
  legitimately diverge and the rest is not compared. Returns True on such a tie."""
  assert len(ours) == len(ref), f"{where}: {len(ours)} tokens, expected {len(ref)}"
  i = next((i for i, (a, r) in enumerate(zip(ours, ref)) if a != r), None)
  if i is None:
    return False
  logits = tt.logits_of(target, [prompt + ref[:i]])[0, -1]
  order = np.argsort(logits)
  gap = logits[order[-1]] - logits[order[-2]]
  assert ours[i] == order[-2] and gap < TIE_GAP, (
      f"{where}: step {i} speculative {ours[i]} autoregressive {ref[i]} (top-2 gap {gap:.2e})")
  return True


def test_every_registered_drafter_is_covered():
  """The greedy battery covers every registered drafter family: a new registration fails here
  until it is added to `_GREEDY_DRAFTERS` (and to the sampling battery)."""
  assert {family for family, _ in _GREEDY_DRAFTERS.values()} == set(drafters.names())


def test_autoregressive_rows_do_not_depend_on_batch(ar):
  """The reference itself: AR greedy of a prompt is the same alone and in a batch of 4 with
  unequal prompt lengths (right padding and per-row lengths are handled). AR is the empty tree:
  each of the 4 rows runs 127 rounds of 0 accepted nodes, tau = 1."""
  alone, batched, stats = ar
  for i, row in batched.items():
    assert row == alone[i], f"prompt {i}"
    assert len(row) == NEW
  for s in stats:
    assert s.accepted_by_depth == (4 * (NEW - 1),)
    assert s.tau == 1.0 and s.target_calls == NEW and s.drafter_calls == 0


def _check_stats(stats, drafter, batch):
  """Bookkeeping that must hold for any drafter without EOS: one draft call per round; the
  histogram has N + 1 bins; each row-round emits (accepted + 1) tokens, so the emitted total
  (first token + rounds) exceeds the kept max_new_tokens per row by at most the last round's
  overshoot (< N + 1 per row); with one row it counts exactly target_calls - 1 rounds."""
  hist = np.asarray(stats.accepted_by_depth)
  assert len(hist) == drafter.num_nodes + 1
  assert stats.drafter_calls == stats.target_calls - 1
  assert stats.new_tokens == batch * NEW
  emitted = batch + np.sum(hist * (np.arange(len(hist)) + 1))
  assert 0 <= emitted - batch * NEW <= batch * drafter.num_nodes
  rounds = stats.target_calls - 1
  if batch == 1:
    assert hist.sum() == rounds
    assert stats.tau == pytest.approx(NEW / stats.target_calls, rel=1e-12)
  else:
    assert rounds <= hist.sum() <= batch * rounds


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", list(_GREEDY_DRAFTERS))
def test_greedy_equals_autoregressive(target, greedy_drafters, ar, name, batch):
  """Temperature 0: every drafter emits the autoregressive greedy tokens, token for token, over
  prompts with and without repetition (10 prompts one by one or 40 in batches of 4 with unequal
  lengths: 50 prompts x 128 tokens per drafter over both parametrizations). The stats are
  consistent with the tokens (`_check_stats`). Premise: the drafter is not vacuous, i.e. some
  draft nodes were accepted. Float ties (top-2 gap < 1e-4) are tolerated at most once."""
  drafter = greedy_drafters[name]
  alone = ar[0]
  ties, accepted = 0, 0
  for group in _groups(batch):
    result = specjax.generate(target, [PROMPTS[i] for i in group], max_new_tokens=NEW,
                              drafter=drafter, pad_to=PAD)
    for i, row in zip(group, result.tokens):
      ties += _assert_greedy_equal(target, PROMPTS[i], row, alone[i], f"{name}, prompt {i}")
    _check_stats(result.stats, drafter, batch)
    hist = np.asarray(result.stats.accepted_by_depth)
    accepted += int(np.sum(hist * np.arange(len(hist))))
  assert ties <= 1
  assert accepted > 0, "no draft node was ever accepted: the test would not exercise acceptance"


_TIED_DRAFTERS = ("prompt_lookup_tree", "ngram", "eagle", "dflash_chain")


@pytest.mark.parametrize("name", _TIED_DRAFTERS)
def test_greedy_equals_autoregressive_with_a_tied_head(name):
  """A tied LM head, which a CPU program reads from a copy of the embedding laid out [E, V]
  (`decoder.head_kernel`): drafters of each kind (chains, trees, learned heads over the tied
  table) still emit the autoregressive tokens, 10 prompts one by one."""
  target = tt.scaled_target(dataclasses.replace(tt.GREEDY_CONFIG, tie_word_embeddings=True), 0)
  drafter = _GREEDY_DRAFTERS[name][1](target)
  ties, accepted = 0, 0
  for prompt in PROMPTS[:BATCH1_PROMPTS]:
    ref = specjax.generate(target, [prompt], max_new_tokens=NEW, pad_to=PAD).tokens[0]
    result = specjax.generate(target, [prompt], max_new_tokens=NEW, drafter=drafter, pad_to=PAD)
    ties += _assert_greedy_equal(target, prompt, result.tokens[0], ref, f"{name} (tied)")
    hist = np.asarray(result.stats.accepted_by_depth)
    accepted += int(np.sum(hist * np.arange(len(hist))))
  assert ties <= 1
  assert accepted > 0, "no draft node was ever accepted: the test would not exercise acceptance"


@pytest.mark.parametrize("batch", [1, 4])
def test_verify_sizes_change_only_the_cost(target, batch):
  """A round verified at the smallest of the drafter's verify sizes that holds every live row's
  valid nodes is the round verified whole: the n-gram model with sizes 0, 1, .., 4 and the same
  drafter verified at all 5 nodes every round emit the same tokens in the same rounds with the
  same acceptances. `rounds_by_size` counts every round once, at sizes the drafts needed (here
  several of them), and a drafter with one size reports none."""
  bucketed = drafters.build("ngram", target, num_tokens=5, match_scale=2.0,
                            verify_sizes=(0, 1, 2, 3, 4))
  whole = bucketed.replace(verify_sizes=())
  used = set()
  for group in _groups(batch)[:4]:
    prompts = [PROMPTS[i] for i in group]
    a = specjax.generate(target, prompts, max_new_tokens=NEW, drafter=bucketed, pad_to=PAD)
    b = specjax.generate(target, prompts, max_new_tokens=NEW, drafter=whole, pad_to=PAD)
    assert a.tokens == b.tokens
    assert a.stats.accepted_by_depth == b.stats.accepted_by_depth
    assert a.stats.target_calls == b.stats.target_calls and a.stats.row_calls == b.stats.row_calls
    assert set(a.stats.rounds_by_size) == {0, 1, 2, 3, 4, 5}
    assert sum(a.stats.rounds_by_size.values()) == a.stats.target_calls - 1
    assert b.stats.rounds_by_size == {}
    used |= {n for n, k in a.stats.rounds_by_size.items() if k}
  assert len(used) >= 3, used


@pytest.mark.parametrize("batch", [1, 4])
def test_identical_drafter_accepts_everything(target, greedy_drafters, batch):
  """draft_lm with the target itself as draft (5 tokens): every node of every round is accepted,
  so each round emits 6 tokens and tau = 128 / (1 + ceil(127 / 6)) = 128 / 23, the 6 below 7
  only because the last round is cut at max_new_tokens (a draft-cache desync or an off-by-one in
  the chain would show up as a partial acceptance)."""
  drafter = greedy_drafters["draft_lm_self"]
  rounds = -(-(NEW - 1) // 6)
  for group in _groups(batch)[:3]:
    stats = specjax.generate(target, [PROMPTS[i] for i in group], max_new_tokens=NEW,
                             drafter=drafter, pad_to=PAD).stats
    assert stats.target_calls == 1 + rounds
    assert stats.accepted_by_depth == (0,) * 5 + (batch * rounds,)
    assert stats.tau == pytest.approx(NEW / (1 + rounds), rel=1e-12) and stats.tau > 5
    assert stats.acceptance_by_depth == (1.0,) * 5


_CHAIN_DRAFTERS = {
    "autoregressive": lambda t: None,
    "prompt_lookup_chain": lambda t: drafters.build("prompt_lookup", t, num_branches=1),
    "ngram": lambda t: drafters.build("ngram", t),
    "token_recycling_chain": lambda t: drafters.build("token_recycling", t,
                                                      paths=TreeTemplate.chain(4).paths),
    "layer_skip": lambda t: drafters.build("layer_skip", t, num_layers=1),
    "draft_lm_self": lambda t: draft_lm.build(t, draft=t, num_tokens=3),
    "dflash_chain": lambda t: tt.learned_drafter("dflash", t),
}


@pytest.mark.parametrize("name", list(_CHAIN_DRAFTERS))
def test_chain_rounds_update_the_cache_in_place(monkeypatch, name):
  """Autoregressive and chain rounds keep every layer's KV cache in place: the compiled program
  copies no [B, S, K, D] cache buffer in its loop, nor in the conditionals the loop runs (the
  n-gram model's verification at one of three sizes). (Autoregressive rounds committed their
  one row by moving it onto itself, and XLA then copied every layer's K and V twice per round;
  a `lax.switch` over verify sizes copied them all in every branch.) On a target with 2 KV
  heads, as the embedded one: with a single KV head XLA's CPU fusion of the one-row write still
  copies each layer's cache."""
  target = tt.scaled_target(tt.config(tt.GREEDY_VOCAB, num_heads=4, num_kv_heads=2), seed=0)
  programs = []
  compiled = decoding.compiled

  def spy(spec, args, cache):
    program, seconds = compiled(spec, args, cache)
    programs.append(program)
    return program, seconds

  monkeypatch.setattr(decoding, "compiled", spy)
  specjax.generate(target, [PROMPTS[1]], max_new_tokens=NEW, drafter=_CHAIN_DRAFTERS[name](target),
                   pad_to=PAD)
  hlo = programs[-1].as_text()
  computations = {c.split(" ", 1)[0]: c for c in re.split(r"\n(?=%)", hlo)}
  loops = [computations[body] for body in re.findall(r"body=(%[\w.\-]+)", hlo)]
  assert loops, "no while loop in the program"
  called = r"(?:true_computation|false_computation)=(%[\w.\-]+)|branch_computations=\{([^}]*)\}"
  for body in loops:  # the branches of conditionals in a loop run in that loop (appended: walked)
    for true_or_false, branches in re.findall(called, body):
      names = [true_or_false] if true_or_false else re.findall(r"%[\w.\-]+", branches)
      loops.extend(computations[n] for n in names if computations[n] not in loops)
  cfg = target.config
  layer = rf"\w+\[1,\d+,{cfg.num_kv_heads},{cfg.head_dim}\]"
  copies = [c for body in loops for c in re.findall(rf"= {layer}\{{[^}}]*\}} copy\(", body)]
  assert not copies, f"{len(copies)} copies of a layer's KV cache per round: {copies[:2]}"


# ------------------------------------------------------------------------------------------------
# 2. Sampling: chi-square against the exact law of the first three tokens.



@pytest.fixture(scope="module")
def sampling_target():
  return tt.sampling_target()


def _top_k_drafter(method: str, target, **options):
  """A learned drafter whose children are its top-k at every temperature (recursive rejection
  over deterministic children; sampled children: tests/test_sampled_children.py)."""
  return tt.learned_drafter(method, target, children="top_k", **options)


# name -> builder. q-based chains (sampled drafts), deterministic trees, and the baseline.
_SAMPLING_DRAFTERS = {
    "none": lambda t: None,
    "layer_skip": lambda t: drafters.build("layer_skip", t, num_layers=1, num_tokens=3),
    "draft_lm_random": lambda t: draft_lm.build(t, draft=tt.sampling_draft(), num_tokens=3),
    "draft_lm_self": lambda t: draft_lm.build(t, draft=t, num_tokens=2),
    "token_recycling": lambda t: drafters.build("token_recycling", t),
    "prompt_lookup": lambda t: drafters.build("prompt_lookup", t, num_tokens=3, num_branches=3),
    "ngram": lambda t: drafters.build("ngram", t, num_tokens=3, verify_sizes=(0, 1)),
    "medusa": lambda t: _top_k_drafter("medusa", t),
    "hydra": lambda t: _top_k_drafter("hydra", t),
    "hydra_recent": lambda t: _top_k_drafter("hydra", t, d2t=np.arange(4), recent_tokens=6),
    "eagle": lambda t: _top_k_drafter("eagle", t, depth=3, top_k=3, total_tokens=8),
    "eagle_recent": lambda t: _top_k_drafter("eagle", t, d2t=np.arange(3), depth=3, top_k=3,
                                                 total_tokens=8, recent_tokens=6),
    "eagle3": lambda t: _top_k_drafter("eagle3", t, depth=3, top_k=3, total_tokens=8),
    "eagle3_recent": lambda t: _top_k_drafter("eagle3", t, d2t=np.arange(3), depth=3,
                                                  top_k=3, total_tokens=8, recent_tokens=6),
    "dflash_chain": lambda t: _top_k_drafter("dflash", t, depth=3),
    "dflash_tree": lambda t: _top_k_drafter("dflash", t, depth=3, top_k=3, total_tokens=8),
    "dflash_recent": lambda t: _top_k_drafter("dflash", t, d2t=np.arange(3), depth=3,
                                                  top_k=3, total_tokens=8, recent_tokens=6),
}


# The suite's cases: every drafter that is not a learned family at both samplings, and the
# learned families' top-k trees (one-hot q, `Tree.draft` None) at one sampling each, one per
# tree builder: a static template (Medusa), EAGLE-2's dynamic tree, DFlash's chain of marginals,
# and DFlash's tree over a few ids plus the history's recent tokens at the sampling that also
# cuts the support (top-p). The other families' builders, and Hydra's and EAGLE-3's reduced
# vocabularies with recent tokens, run with sampled children in tests/test_sampled_children.py
# (the same builders and verification rows); SPECJAX_FULL_BATTERY=1 runs every drafter here at
# both samplings.
_LEARNED_CASES = {"medusa": "T1", "eagle": "T1", "dflash_chain": "T0.7_p0.9",
                  "dflash_recent": "T0.7_p0.9"}
_LEARNED = ("medusa", "hydra", "hydra_recent", "eagle", "eagle_recent", "eagle3",
            "eagle3_recent", "dflash_chain", "dflash_tree", "dflash_recent")
_SAMPLING_CASES = [(name, sampling) for name in _SAMPLING_DRAFTERS for sampling in SAMPLINGS
                   if FULL_BATTERY or name not in _LEARNED
                   or _LEARNED_CASES.get(name) == sampling]


@pytest.fixture(scope="module")
def sampling_drafters(sampling_target):
  return {name: build(sampling_target) for name, build in _SAMPLING_DRAFTERS.items()}


def test_sampling_target_has_structure(sampling_target):
  """Premise of the sampling tests: the tiny target's laws are far from uniform and differ by
  previous token and by position in the window, so a bug that reads the wrong row of p (another
  block position) or ignores the prefix moves probability mass visibly."""
  v, n = tt.SAMPLING_VOCAB, len(SAMPLING_PROMPT)
  logits = tt.logits_of(sampling_target, [SAMPLING_PROMPT + [a, b] for a in range(v)
                                          for b in range(v)])
  p = np.asarray(target_probs(logits, SamplingConfig(1.0)), np.float64)
  entropy = -np.sum(p * np.log(np.maximum(p, 1e-30)), axis=-1)
  assert entropy[:, n - 1:].mean() < 0.75 * np.log(v)
  def tv(a, b):
    return 0.5 * np.abs(a - b).sum(-1)
  p1, p2, p3 = p[0, n - 1], p[::v, n], p[:, n + 1].reshape(v, v, v)
  assert tv(p2[:, None], p2[None]).mean() > 0.2  # x2's law depends on x1
  assert tv(p3[:, :, None], p3[:, None, :]).mean() > 0.2  # x3's law depends on x2
  assert tv(p3[:, None], p3[None]).mean() > 0.1  # ... and on x1, two positions back
  assert tv(p1[None], p2).mean() > 0.2 and tv(p2[:, None], p3).mean() > 0.2  # rows differ


@pytest.mark.slow
@pytest.mark.parametrize("name, sampling", _SAMPLING_CASES)
def test_sampling_matches_exact_law(sampling_target, sampling_drafters, name, sampling):
  """N copies of one prompt, generated in ONE batched call with 3 new tokens (each row has its
  own rng stream: independent draws): the joint counts of (x1, x2, x3) follow the exact law of
  the target (`exact_law`), by a Pearson chi-square test with cells of expected count < 5 pooled,
  rejected at ALPHA = 1e-6 (Bonferroni: the 19 such tests here have a family-wise false-alarm
  probability <= 1.9e-5). The test asserts its own power: >= 0.99 against a bias of
  D = sum (r - p)^2 / p = 0.01 over the pooled cells; N is the fewest rows giving >= 0.999
  (`rows_for`: 24576 at T = 1, 12288 under top-p 0.9, whose law has fewer cells).

  x1 comes from the prefill, x2 and x3 from the first round(s): accepted drafts or the bonus
  token, so rows that reject early test the residual draw. Cases: the q-based chain rule
  (layer_skip and a random draft LM sampled with q; the target as its own draft LM, where every
  draft must be accepted), the recursive tree rule (Token Recycling's 14-node tree, prompt
  lookup's 3 branches, the n-gram model's chain verified at 0, 1 or 3 nodes, the top-k trees of
  random Medusa, Hydra, EAGLE and EAGLE-3 drafters, DFlash's argmax chain and best-first tree
  from its block's marginals, and of Hydra, EAGLE, EAGLE-3 and DFlash over 3-4 ids plus the
  history's recent tokens), and drafter=None, which separates sampler bugs from speculation
  bugs.
  Zero-probability outcomes (outside top-p) must never occur."""
  seed = 100 * list(_SAMPLING_DRAFTERS).index(name) + list(SAMPLINGS).index(sampling)
  check_exact_law(sampling_target, sampling_drafters[name], name, SAMPLINGS[sampling], seed)


# The drafter-less baseline with temperature and top-p (the sampler's own sharding); with
# SPECJAX_FULL_BATTERY=1 also prompt lookup's tree and EAGLE's dynamic one. That a sharded run
# draws the very tokens of one device, for model-free and learned drafters and each rule, is
# tests/test_sharding.py's `test_sampled_output_identical_across_meshes`: with the battery on
# one device it gives the law on every mesh.
_MESH_SAMPLING_CASES = (("none", "T0.7_p0.9"),) + (
    (("eagle", "T1"), ("prompt_lookup", "T0.7_p0.9")) if FULL_BATTERY else ())


@pytest.fixture(scope="module")
def mesh_sampling_target():
  """A tiny sampling target whose 8 query heads split 4 ways (its 2 KV heads replicated), on
  dp=2,tp=4 of the session's 8 CPU devices."""
  return tt.mesh_sampling_target().on_mesh("dp=2,tp=4")


@pytest.mark.slow
@pytest.mark.parametrize("name, sampling", _MESH_SAMPLING_CASES)
def test_sampling_matches_exact_law_on_a_mesh(mesh_sampling_target, name, sampling):
  """The exact-law battery above on a dp=2,tp=4 mesh (rows over data, heads over model):
  sampled speculative decoding keeps exactly the target's law when sharded."""
  drafter = _SAMPLING_DRAFTERS[name](mesh_sampling_target)
  seed = 7000 + [n for n, _ in _MESH_SAMPLING_CASES].index(name)
  check_exact_law(mesh_sampling_target, drafter, name, SAMPLINGS[sampling], seed)


# ------------------------------------------------------------------------------------------------
# 3. Bad input and the edges of a round.


def test_drafter_vocab_mismatch_is_rejected(target):
  """A draft LM of another vocabulary cannot propose the target's token ids: ValueError naming
  the vocab sizes, at build time (before anything is compiled)."""
  other = tt.scaled_target(tt.config(tt.GREEDY_VOCAB + 4, num_layers=1), seed=3)
  with pytest.raises(ValueError, match=r"vocab_size 100 != target vocab_size 96"):
    draft_lm.build(target, draft=other)


def test_unknown_drafter_name_lists_registered(target):
  """An unknown name raises ValueError listing every registered drafter."""
  with pytest.raises(ValueError, match="unknown drafter 'medusa_typo'") as err:
    drafters.build("medusa_typo", target)
  for name in drafters.names():
    assert repr(name) in str(err.value)


def test_max_new_tokens_cuts_an_accepted_path(target, greedy_drafters, ar):
  """max_new_tokens = 128 with 6 tokens per round (the target as its 5-token draft LM, all
  accepted): 1 + 22 * 6 = 133 tokens are emitted and the last round's path is cut after its
  first node. Exactly 128 tokens come out per row, equal to autoregressive decoding."""
  alone = ar[0]
  group = _groups(4)[0]
  result = specjax.generate(target, [PROMPTS[i] for i in group], max_new_tokens=NEW,
                            drafter=greedy_drafters["draft_lm_self"], pad_to=PAD)
  assert result.stats.accepted_by_depth[-1] == 4 * 22 and result.stats.target_calls == 23
  assert result.tokens == [alone[i] for i in group]
  assert result.stats.new_tokens == 4 * NEW


def _truncate(row, eos):
  return row[:row.index(eos) + 1] if eos in row else row


def _eos_case(alone):
  """(group, eos): a batch-4 group and a token that the group's first row emits for the first
  time inside an accepted path of 6-token rounds (index j, j % 6 != 0: neither the prefill token
  nor a bonus token), that another row emits at a different step, and that some row never
  emits (it must run on to max_new_tokens)."""
  for group in _groups(4):
    rows = [alone[i] for i in group]
    for eos in range(tt.GREEDY_VOCAB):
      first = [r.index(eos) if eos in r else None for r in rows]
      if (first[0] is not None and first[0] % 6 != 0 and first[0] < NEW - 6
          and None in first and any(f not in (None, first[0]) for f in first[1:])):
        return group, eos
  raise AssertionError("no suitable EOS case in the prompts")


@pytest.mark.parametrize("name", ["draft_lm_self", "prompt_lookup_tree", "token_recycling_tree",
                                  "layer_skip"])
def test_eos_stops_rows_independently(target, greedy_drafters, ar, name):
  """EOS in a batch of 4: each row stops at its first EOS (kept, nothing after it), also when the
  EOS is an accepted draft in the middle of a path; rows that finish early stop cleanly while
  the others continue to max_new_tokens with unchanged tokens. Reference: each row's
  autoregressive run alone with the same EOS."""
  alone = ar[0]
  group, eos = _eos_case(alone)
  expect = [specjax.generate(target, [PROMPTS[i]], max_new_tokens=NEW, pad_to=PAD,
                             eos_token_id=eos).tokens[0] for i in group]
  assert expect == [_truncate(alone[i], eos) for i in group]
  result = specjax.generate(target, [PROMPTS[i] for i in group], max_new_tokens=NEW,
                            drafter=greedy_drafters[name], pad_to=PAD, eos_token_id=eos)
  assert result.tokens == expect
  assert result.stats.new_tokens == sum(map(len, expect))
  assert result.tokens[0][-1] == eos and len(result.tokens[0]) < NEW
  assert any(len(r) == NEW for r in result.tokens)
  if name == "draft_lm_self":
    # All nodes accepted: row 0's EOS sits at depth j % 6 of its round's path, not the bonus.
    assert (len(result.tokens[0]) - 1) % 6 != 0


# ------------------------------------------------------------------------------------------------
# 4. pad_to.


def test_pad_to_does_not_change_the_output(target, greedy_drafters, ar):
  """Prompts padded to 40 instead of the default bucket (32) give the same tokens: padding is
  masked everywhere, including Token Recycling's table seeding from the prefill."""
  alone = ar[0]
  drafter = greedy_drafters["token_recycling_tree"]
  group = _groups(4)[1]
  prompts = [PROMPTS[i] for i in group]
  default = specjax.generate(target, prompts, max_new_tokens=NEW, drafter=drafter)
  padded = specjax.generate(target, prompts, max_new_tokens=NEW, drafter=drafter, pad_to=40)
  assert default.tokens == padded.tokens == [alone[i] for i in group]


def test_pad_to_shorter_than_prompt_is_rejected(target):
  with pytest.raises(ValueError, match=r"pad_to=8 is shorter than the longest prompt \(12\)"):
    specjax.generate(target, [[1] * 5, [2] * 12], max_new_tokens=4, pad_to=8)
