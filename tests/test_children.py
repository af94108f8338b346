"""`specjax.children.pick` in isolation: the law of the children it draws in each mode (exact
laws on a small vocabulary, chi-square over many keys), the slot scores that rank them, and its
refusals. The trees built on it are checked end to end by tests/test_sampled_children.py."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.children import Children, check, pick
from specjax.sampling import GREEDY, SamplingConfig
from tests.helpers.stats import pooled_chi_square

V, K, DRAWS = 6, 3, 20_000
LOGP = jnp.log(jnp.asarray([[[0.35, 0.25, 0.2, 0.1, 0.07, 0.03],
                             [0.6, 0.0, 0.3, 0.1, 0.0, 0.0]]], jnp.float32))  # [1, 2, V]
T1 = SamplingConfig(1.0)


def _draws(mode: str, sampling: SamplingConfig = T1, children: Children | None = None):
  """DRAWS picks for the two parents of LOGP under independent keys: tokens and ok, [n, 2, K]."""
  children = Children(mode) if children is None else children
  keys = jax.random.split(jax.random.key(0), DRAWS)
  picked = jax.vmap(lambda key: pick(children, sampling, key, LOGP, K))(keys)
  return np.asarray(picked.tokens)[:, 0], np.asarray(picked.ok)[:, 0], picked


def _q(parent: int, temperature: float = 1.0) -> np.ndarray:
  q = np.exp(np.asarray(LOGP[0, parent], np.float64) / temperature)
  return q / q.sum()


def _assert_law(observed: np.ndarray, probs: np.ndarray) -> None:
  counts = np.bincount(observed, minlength=len(probs))
  _, dof, p = pooled_chi_square(counts, probs)
  assert dof > 0 and p > 1e-4, (counts, probs * len(observed), p)


@pytest.mark.parametrize("mode", ["top_k", "iid", "wor"])
def test_greedy_and_top_k_are_lax_top_k(mode):
  """At T = 0 every mode, and top-k at any temperature, is `lax.top_k` of the draft log-probs,
  every slot ok and no q: the deterministic tree of old, bit for bit."""
  scores, tokens = jax.lax.top_k(LOGP, K)
  for sampling in (GREEDY, T1) if mode == "top_k" else (GREEDY,):
    picked = pick(Children(mode), sampling, jax.random.key(3), LOGP, K)
    np.testing.assert_array_equal(picked.tokens, tokens)
    np.testing.assert_array_equal(picked.scores, scores)
    assert bool(picked.ok.all()) and picked.q is None


def test_iid_children_are_independent_draws_from_q():
  """Each i.i.d. child is a draw from q, and a pair of siblings is drawn with q(a) q(b): the
  joint law of the first two, over the 36 ordered pairs (repeats included)."""
  tokens, ok, picked = _draws("iid")
  assert ok.all()
  np.testing.assert_allclose(np.asarray(picked.q[0, 0, 0]), _q(0), rtol=1e-5)
  q = _q(0)
  for slot in range(K):
    _assert_law(tokens[:, 0, slot], q)
  _assert_law(tokens[:, 0, 0] * V + tokens[:, 0, 1], np.outer(q, q).ravel())


def test_children_without_replacement_follow_the_sequential_law():
  """Gumbel-top-k draws sibling i from q without its earlier siblings' tokens, renormalised:
  the ordered triple's law is q(a) q(b) / (1 - q(a)) q(c) / (1 - q(a) - q(b)), exactly; siblings
  never repeat."""
  tokens, ok, _ = _draws("wor")
  assert ok[:, 0].all() and all(len(set(row)) == K for row in tokens[:, 0])
  q = _q(0)
  law = np.zeros(V ** K)
  for a, b, c in itertools.permutations(range(V), K):
    law[(a * V + b) * V + c] = q[a] * q[b] / (1 - q[a]) * q[c] / (1 - q[a] - q[b])
  assert np.isclose(law.sum(), 1.0)
  _assert_law((tokens[:, 0, 0] * V + tokens[:, 0, 1]) * V + tokens[:, 0, 2], law)


def test_draws_without_replacement_stop_at_qs_support():
  """A parent whose q has fewer than k tokens in its support gets that many children: the slot
  past it is not ok (no node), and its score is -inf, so no tree keeps it."""
  keys = jax.random.split(jax.random.key(1), 200)
  picked = jax.vmap(lambda key: pick(Children("wor"), T1, key, LOGP, 4))(keys)
  ok, tokens, scores = (np.asarray(x)[:, 0, 1] for x in (picked.ok, picked.tokens, picked.scores))
  assert ok[:, :3].all() and not ok[:, 3].any()  # q(parent 1) has 3 tokens
  assert all(set(row[:3]) == {0, 2, 3} for row in tokens) and np.isneginf(scores[:, 3]).all()


@pytest.mark.parametrize("mode", ["iid", "wor"])
def test_slot_scores_do_not_read_the_drawn_tokens(mode):
  """A sampled child's score is its slot's, the i-th largest log q at its parent, whatever was
  drawn: the same under every key (ranking by the drawn token's own q would bias it)."""
  _, _, picked = _draws(mode)
  scores = np.asarray(picked.scores)
  expected = np.asarray(jax.lax.top_k(jax.nn.log_softmax(LOGP[:, :1]), K)[0])
  np.testing.assert_allclose(scores[:, :, :1], np.broadcast_to(expected, scores[:, :, :1].shape),
                             rtol=1e-6)


def test_a_draft_temperature_of_its_own_sets_q():
  """`draft_temperature` draws from softmax(logp / t) whatever the run's temperature, and the
  q handed to verification is that one."""
  children = Children("iid", temperature=0.5)
  tokens, _, picked = _draws("iid", SamplingConfig(1.3), children)
  np.testing.assert_allclose(np.asarray(picked.q[0, 0, 0]), _q(0, 0.5), rtol=1e-5)
  _assert_law(tokens[:, 0, 0], _q(0, 0.5))


def test_bad_children_options_are_refused_by_name():
  with pytest.raises(ValueError, match=r"children must be one of \['top_k', 'iid', 'wor'\]"):
    Children("beam")
  with pytest.raises(ValueError, match="children must be one of"):
    check(3)
  with pytest.raises(ValueError, match="draft_temperature applies to sampled children"):
    Children("top_k", temperature=0.5)
  for bad in (0.0, -1.0, float("inf")):
    with pytest.raises(ValueError, match="draft_temperature must be a float > 0"):
      Children("wor", temperature=bad)
  assert check("wor", 0.7) == Children("wor", 0.7) and check(Children("iid")) == Children("iid")
