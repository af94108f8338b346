"""Sampled children are lossless: the exact-law battery for learned drafters whose children are
drawn from their q (`specjax.children`), under each lossless rule, and the lossy rule seen.

  1. every learned family (Medusa and Hydra's static templates, EAGLE and EAGLE-3's dynamic tree,
     DFlash's best-first tree of marginals; Hydra and EAGLE-3 over a few ids plus the history's
     recent tokens, so q covers a reduced vocabulary) x {i.i.d. children under recursive
     rejection, children without replacement under recursive rejection, i.i.d. children under
     SpecTr's k-sequential selection} x {T = 1, T = 0.7 with top-p 0.9}: the joint law of the
     first three tokens against the target's exact law (`tests/helpers/exact_law.py`), on one
     device and on dp=2,tp=4;
  2. typical acceptance, the lossy rule, is detected as such by the same statistics;
  3. at T = 0 the sampled modes are the top-k drafter bit for bit;
  4. a rule that needs i.i.d. children refuses other drafters (at T > 0 only).

Each chi-square test rejects at ALPHA = 1e-6; the suite runs 16 of them here (Bonferroni:
family-wise false alarm <= 1.6e-5), SPECJAX_FULL_BATTERY=1 all 60. On the mesh the suite runs
one family (EAGLE-3's children without replacement, over a reduced vocabulary); that every
mesh draws the very tokens of one device, k-sequential selection included, is
tests/test_sharding.py's `test_sampled_output_identical_across_meshes`.
"""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax import trees, verify
from tests.helpers import tiny_targets as tt
from tests.helpers.exact_law import (
    FULL_BATTERY,
    SAMPLING_PAD,
    SAMPLING_PROMPT,
    SAMPLINGS,
    check_exact_law,
    exact_law,
)
from tests.helpers.stats import pooled_chi_square


@pytest.fixture(scope="module")
def sampling_target():
  return tt.sampling_target()


@pytest.fixture(scope="module")
def mesh_sampling_target():
  """The tiny sampling target on dp=2,tp=4 of the session's 8 CPU devices."""
  return tt.mesh_sampling_target().on_mesh("dp=2,tp=4")


# Sampled children (`specjax.children`): every learned family x {i.i.d., without replacement,
# i.i.d. under SpecTr's k-sequential rule} x both samplings. The suite runs a covering half of
# that product, each (family, variant) at one sampling and each variant at both (the sampling
# alternates with the family), so that every pair of the three factors is tested; the whole
# product runs with SPECJAX_FULL_BATTERY=1.
_SAMPLED_FAMILIES = {
    "medusa": dict(),
    "hydra": dict(d2t=np.arange(4), recent_tokens=6),
    "eagle": dict(depth=3, top_k=3, total_tokens=8),
    "eagle3": dict(d2t=np.arange(3), depth=3, top_k=3, total_tokens=8, recent_tokens=6),
    "dflash": dict(depth=3, top_k=3, total_tokens=8),
}
_SAMPLED_VARIANTS = {"iid": ("iid", "recursive"), "wor": ("wor", "recursive"),
                     "iid_kseq": ("iid", "kseq")}
_SAMPLED_CASES = [
    (family, variant, sampling)
    for i, family in enumerate(_SAMPLED_FAMILIES)
    for j, variant in enumerate(_SAMPLED_VARIANTS)
    for k, sampling in enumerate(SAMPLINGS)
    if FULL_BATTERY or (i + j) % 2 == k]


def _sampled_drafter(target, family: str, variant: str):
  children, rule = _SAMPLED_VARIANTS[variant]
  options = dict(_SAMPLED_FAMILIES[family])
  if rule == "kseq" and family in ("eagle", "eagle3"):
    # K-SEQ needs each node's number of children fixed before they are drawn, which EAGLE-2's
    # pruned tree does not (`trees.grown_counts_fixed`): the tree that keeps every candidate.
    options.update(top_k=2, total_tokens=trees.grown_tree_capacity(3, 2))
  return tt.learned_drafter(family, target, children=children, **options)


@pytest.mark.slow
@pytest.mark.parametrize("family, variant, sampling", _SAMPLED_CASES)
def test_sampled_children_match_exact_law(sampling_target, family, variant, sampling):
  """The exact-law battery above for learned drafters whose children are drawn from q: i.i.d.
  (SpecInfer's rule), without replacement (Gumbel-top-k, each sibling's q renormalised without
  the earlier ones) and i.i.d. under SpecTr's k-sequential selection, with static templates
  (Medusa, Hydra over 4 ids plus recent tokens), EAGLE-2's dynamic tree ranked by slot scores
  (EAGLE, EAGLE-3 over 3 ids plus recent tokens: q over a reduced vocabulary, 0 elsewhere) and
  DFlash's best-first tree of sampled marginals."""
  drafter = _sampled_drafter(sampling_target, family, variant)
  seed = (20000 + 100 * list(_SAMPLED_FAMILIES).index(family)
          + 10 * list(_SAMPLED_VARIANTS).index(variant) + list(SAMPLINGS).index(sampling))
  check_exact_law(sampling_target, drafter, f"{family}_{variant}", SAMPLINGS[sampling], seed,
                   rule=_SAMPLED_VARIANTS[variant][1])


def test_typical_acceptance_differs_from_the_exact_law(sampling_target):
  """Typical acceptance is lossy, and the battery sees it: with a drafter that always proposes
  (the target itself as a draft LM, whose every draft clears the threshold where the target is
  confident) the law of the first tokens is off the target's by far more than the test's
  tolerance. This keeps its LOSSY flag honest."""
  drafter = tt.learned_drafter("medusa", sampling_target)
  cfg = SAMPLINGS["T1"]
  law = exact_law(sampling_target, SAMPLING_PROMPT, cfg)
  with pytest.warns(verify.LossyRuleWarning):
    result = specjax.generate(sampling_target, [SAMPLING_PROMPT] * 4096, max_new_tokens=3,
                              drafter=drafter, temperature=1.0, seed=3, pad_to=SAMPLING_PAD,
                              rule="typical")
  v = sampling_target.config.vocab_size
  tokens = np.array(result.tokens)
  counts = np.bincount((tokens[:, 0] * v + tokens[:, 1]) * v + tokens[:, 2], minlength=v ** 3)
  _, _, pvalue = pooled_chi_square(counts, law.reshape(-1))
  assert pvalue < 1e-12, f"typical acceptance matched the target's law (p = {pvalue:.2e})"


@pytest.mark.parametrize("family", ["eagle", "medusa"])
def test_sampled_modes_are_greedy_at_temperature_zero(sampling_target, family):
  """At T = 0 a drafter with sampled children drafts its top-k: tokens and accepted lengths
  bit-identical to the same drafter with top-k children, on prompts of other lengths and
  contents than the battery's."""
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, tt.SAMPLING_VOCAB, int(n)).tolist() for n in (5, 9, 12, 16)]
  runs = []
  for children in ("top_k", "iid", "wor"):
    drafter = tt.learned_drafter(family, sampling_target, children=children)
    runs.append(specjax.generate(sampling_target, prompts, max_new_tokens=24, drafter=drafter,
                                 pad_to=SAMPLING_PAD))
  for run in runs[1:]:
    assert run.tokens == runs[0].tokens
    assert run.stats.accepted_by_depth == runs[0].stats.accepted_by_depth


def test_a_rule_for_iid_children_refuses_other_drafters(sampling_target):
  """k-sequential selection needs i.i.d. children: a top-k or without-replacement drafter is
  refused at T > 0 with an error naming the rule and the mode; at T = 0 (greedy) it runs."""
  for children in ("top_k", "wor"):
    drafter = tt.learned_drafter("medusa", sampling_target, children=children)
    with pytest.raises(ValueError, match=f"kseq.*{children}"):
      specjax.generate(sampling_target, [SAMPLING_PROMPT], max_new_tokens=3, drafter=drafter,
                       temperature=1.0, rule="kseq")
    specjax.generate(sampling_target, [SAMPLING_PROMPT], max_new_tokens=3, drafter=drafter,
                     rule="kseq")
  # Autoregressive decoding has nothing to accept: every rule runs it, as the same program.
  plain = specjax.generate(sampling_target, [SAMPLING_PROMPT], max_new_tokens=3, temperature=1.0)
  for rule in ("kseq", "typical"):
    ar = specjax.generate(sampling_target, [SAMPLING_PROMPT], max_new_tokens=3, temperature=1.0,
                          rule=rule)
    assert ar.tokens == plain.tokens and ar.stats.compile_seconds == 0.0, rule
  with pytest.raises(ValueError, match="rule must be one of"):
    specjax.generate(sampling_target, [SAMPLING_PROMPT], max_new_tokens=3, rule="magic")
  with pytest.raises(ValueError, match="children must be one of"):
    tt.learned_drafter("medusa", sampling_target, children="beam")


# Sampled children on the mesh: the suite runs one case (the module docstring); the whole
# product with SPECJAX_FULL_BATTERY=1.
_MESH_SAMPLED_CASES = (_SAMPLED_CASES if FULL_BATTERY else [("eagle3", "wor", "T0.7_p0.9")])


@pytest.mark.slow
@pytest.mark.parametrize("family, variant, sampling", _MESH_SAMPLED_CASES)
def test_sampled_children_match_exact_law_on_a_mesh(mesh_sampling_target, family, variant,
                                                    sampling):
  """`test_sampled_children_match_exact_law` on dp=2,tp=4."""
  drafter = _sampled_drafter(mesh_sampling_target, family, variant)
  seed = (27000 + 100 * list(_SAMPLED_FAMILIES).index(family)
          + 10 * list(_SAMPLED_VARIANTS).index(variant) + list(SAMPLINGS).index(sampling))
  check_exact_law(mesh_sampling_target, drafter, f"{family}_{variant}", SAMPLINGS[sampling],
                   seed, rule=_SAMPLED_VARIANTS[variant][1])
