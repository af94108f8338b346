"""Property-based greedy identity (hypothesis): random drafters, trees and tree options, batch
mixes of prompt lengths up to the context end, and EOS anywhere, in float32.

For every registered drafter family, hypothesis draws the drafter's tree options (random Medusa
"choices", EAGLE-2 depth / top_k / total_tokens, prompt-lookup n-gram settings, Token Recycling
templates, chain lengths, recent tokens) and a batch of three prompts whose lengths range from 1
token to the last one that fits the context with `NEW` new tokens (the cache and the tree run up
to the context end). The speculative output must equal autoregressive decoding of the same batch
token for token, with the EOS id drawn at random (or none), every token inside the vocabulary.

Examples are derandomised (the same on every run) and few per family: each option set is a new
compiled program. The shapes that do not depend on the options (batch, padding, new tokens) are
fixed so that autoregressive decoding compiles once.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specjax
from specjax import drafters
from specjax.drafters import draft_lm
from tests.helpers import tiny_targets as tt

CONTEXT = tt.GREEDY_CONFIG.max_position_embeddings
NEW = 24
PAD = CONTEXT - NEW  # the longest prompt that fits: its last new token is the context's last
BATCH = 3
EXAMPLES = 3

_TARGET = tt.greedy_target()
_DRAFT = tt.draft_target()


@st.composite
def rank_paths(draw, max_nodes: int, max_depth: int, max_rank: int = 3):
  """A prefix-closed set of Medusa-style rank paths (a random static tree)."""
  paths = [(0,)]
  for _ in range(draw(st.integers(0, max_nodes - 1))):
    parent = draw(st.sampled_from([()] + [p for p in paths if len(p) < max_depth]))
    used = {p[-1] for p in paths if p[:-1] == parent}
    free = [r for r in range(max_rank) if r not in used]
    if free:
      paths.append(parent + (draw(st.sampled_from(free)),))
  return tuple(paths)


def _d2t(draw):
  """The whole vocabulary, or a random third of it with recent tokens to make up for it."""
  if draw(st.booleans()):
    return {}
  keep = draw(st.lists(st.integers(0, tt.GREEDY_VOCAB - 1), min_size=8, max_size=32,
                       unique=True))
  return dict(d2t=np.asarray(sorted(keep)), recent_tokens=draw(st.sampled_from([0, 4, 16])))


@st.composite
def drafter_for(draw, family: str):
  t = _TARGET
  if family == "prompt_lookup":
    hi = draw(st.integers(1, 4))
    return drafters.build(family, t, num_tokens=draw(st.integers(1, 6)),
                          num_branches=draw(st.integers(1, 3)), max_ngram=hi,
                          min_ngram=draw(st.integers(1, hi)))
  if family == "ngram":
    n, hi = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    scale = draw(st.sampled_from([None, 0.5, 1.0, 3.0]))
    return drafters.build(family, t, num_tokens=n, max_ngram=hi,
                          min_ngram=draw(st.integers(1, hi)), match_scale=scale,
                          verify_sizes=draw(st.lists(st.integers(0, n), max_size=3)))
  if family == "token_recycling":
    return drafters.build(family, t, paths=draw(rank_paths(10, 5)))
  if family == "layer_skip":
    return drafters.build(family, t, num_layers=1, num_tokens=draw(st.integers(1, 6)))
  if family == "draft_lm":
    return draft_lm.build(t, draft=_DRAFT, num_tokens=draw(st.integers(1, 6)))
  seed = draw(st.integers(0, 3))
  if family in ("medusa", "hydra"):
    return tt.learned_drafter(family, t, seed=seed, choices=draw(rank_paths(12, 4)),
                              **_d2t(draw))
  depth, top_k = draw(st.integers(1, 5)), draw(st.integers(1, 3))
  total = draw(st.integers(1, top_k + (depth - 1) * top_k * top_k))
  return tt.learned_drafter(family, t, seed=seed, depth=depth, top_k=top_k,
                            total_tokens=total, **_d2t(draw))


@st.composite
def batches(draw):
  """BATCH prompts: one at the context end, one short, one anywhere; random or motif text."""
  lengths = [PAD, draw(st.integers(1, 8)), draw(st.integers(1, PAD))]
  rows = []
  for n in draw(st.permutations(lengths)):
    motif = draw(st.lists(st.integers(0, tt.GREEDY_VOCAB - 1), min_size=1, max_size=6))
    noise = draw(st.lists(st.integers(0, tt.GREEDY_VOCAB - 1), min_size=n, max_size=n))
    rows.append([m if draw(st.booleans()) else x for m, x in zip(motif * n, noise)][:n])
  return rows


_AR: dict[tuple, list[list[int]]] = {}


def _autoregressive(prompts, eos):
  key = (tuple(map(tuple, prompts)), eos)
  if key not in _AR:
    _AR[key] = specjax.generate(_TARGET, prompts, max_new_tokens=NEW, pad_to=PAD,
                                eos_token_id=eos).tokens
  return _AR[key]


def test_every_registered_family_is_fuzzed():
  assert set(FAMILIES) == set(drafters.names())


FAMILIES = ["dflash", "draft_lm", "eagle", "eagle3", "hydra", "layer_skip", "medusa", "ngram",
            "prompt_lookup", "token_recycling"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_under_random_trees_and_batches(family):
  @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck))
  @given(drafter=drafter_for(family), prompts=batches(),
         eos=st.one_of(st.just([]), st.integers(0, tt.GREEDY_VOCAB - 1).map(lambda e: [e])))
  def check(drafter, prompts, eos):
    eos = tuple(eos)
    ours = specjax.generate(_TARGET, prompts, max_new_tokens=NEW, pad_to=PAD,
                            eos_token_id=list(eos), drafter=drafter)
    ref = _autoregressive(prompts, eos)
    for row, (a, r) in enumerate(zip(ours.tokens, ref)):
      assert all(0 <= x < tt.GREEDY_VOCAB for x in a)
      assert a == r, f"row {row} (prompt of {len(prompts[row])} tokens, eos {eos}): {a} != {r}"
    assert np.isfinite(ours.stats.tau) and ours.stats.tau >= 1.0

  check()
