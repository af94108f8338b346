"""The exact-law battery's shared pieces: the tiny sampling target's exact joint law of its first
three tokens, and the check that `generate`'s sampled rows follow it (Pearson chi-square, cells
of expected count < 5 pooled, with its own power asserted)."""

from __future__ import annotations

import os

import numpy as np
import scipy.stats

import specjax
from specjax.sampling import SamplingConfig, target_probs
from tests.helpers import tiny_targets as tt
from tests.helpers.stats import pooled_chi_square

# Sampled rows per test, in one batched call: the fewest of these whose power against a bias of
# D = 0.01 is at least MIN_POWER (`rows_for`; a law cut by top-p has fewer cells to fill).
ROW_COUNTS = (12288, 16384, 20480, 24576)
MIN_POWER = 0.999  # asserted >= 0.99 whatever the rows
ALPHA = 1e-6  # per test (each file states its Bonferroni count)
SAMPLING_PROMPT = [3, 1, 4, 1, 5, 1, 4, 2, 6, 5, 3, 1]  # repeats: prompt lookup proposes at once
SAMPLING_PAD = 16
SAMPLINGS = {"T1": SamplingConfig(1.0), "T0.7_p0.9": SamplingConfig(0.7, top_p=0.9)}
# The suite runs a covering part of each battery; SPECJAX_FULL_BATTERY=1 runs every case.
FULL_BATTERY = os.environ.get("SPECJAX_FULL_BATTERY") == "1"


def top_p_margin(logits: np.ndarray, cfg: SamplingConfig) -> float:
  """Distance of the top-p cut from 1 - top_p over all rows, in float64: a small margin means
  float32 rounding could change the support, and the law would be ill-defined at 1e-6."""
  if cfg.top_p >= 1.0:
    return np.inf
  x = np.sort(np.asarray(logits, np.float64) / cfg.temperature, axis=-1)
  p = np.exp(x - x[..., -1:])
  cum = np.cumsum(p / p.sum(-1, keepdims=True), axis=-1)
  return float(np.min(np.abs(cum - (1.0 - cfg.top_p))))


def exact_law(target, prompt, cfg: SamplingConfig) -> np.ndarray:
  """float64[V, V, V]: P(x1, x2, x3) = p(x1|prompt) p(x2|prompt,x1) p(x3|prompt,x1,x2), from
  one cache-free forward over the V^2 sequences prompt + [x1, x2] and `target_probs` (the same
  temperature / top-p processing the sampler uses; it is checked against transformers' warpers
  in test_decoding.py)."""
  v, n = target.config.vocab_size, len(prompt)
  seqs = [prompt + [a, b] for a in range(v) for b in range(v)]
  logits = tt.logits_of(target, seqs)  # [V*V, n + 2, V]; row a * V + b
  margin = top_p_margin(logits[:, n - 1:], cfg)
  assert margin > 1e-4, "top-p cut within float rounding of 1 - top_p: choose another prompt"
  probs = np.asarray(target_probs(logits, cfg), np.float64)
  probs /= probs.sum(-1, keepdims=True)
  p1 = probs[0, n - 1]  # [V]
  p2 = probs[::v, n]  # [V(x1), V]
  p3 = probs[:, n + 1].reshape(v, v, v)  # [x1, x2, V]
  return p1[:, None, None] * p2[:, :, None] * p3


def power(dof: int, n: int, divergence: float = 0.01) -> float:
  """P(reject at ALPHA) when the sampled law is off by D = sum (r - p)^2 / p = `divergence`
  (noncentral chi-square with lambda = n D)."""
  return float(scipy.stats.ncx2.sf(scipy.stats.chi2.isf(ALPHA, dof), dof, n * divergence))


def pooled_dof(law: np.ndarray, n: int) -> int:
  """The degrees of freedom `pooled_chi_square` has over `n` draws from `law` (the cells of
  expected count >= 5, plus one pooled cell when the rest have any mass, less one)."""
  expected = n * law[law > 0]
  big = int((expected >= 5).sum())
  return big - 1 + int(expected[expected < 5].sum() >= 5 or big == 0)


def rows_for(law: np.ndarray) -> int:
  """The fewest ROW_COUNTS whose chi-square test has power >= MIN_POWER against D = 0.01 on
  `law`, the largest when none has."""
  return next((n for n in ROW_COUNTS if power(pooled_dof(law, n), n) >= MIN_POWER),
              ROW_COUNTS[-1])


def check_exact_law(target, drafter, name: str, cfg: SamplingConfig, seed: int,
                     rule: str = "recursive") -> None:
  v = target.config.vocab_size
  law = exact_law(target, SAMPLING_PROMPT, cfg)
  n_rows = rows_for(law.reshape(-1))
  result = specjax.generate(target, [SAMPLING_PROMPT] * n_rows, max_new_tokens=3,
                            drafter=drafter, temperature=cfg.temperature, top_p=cfg.top_p,
                            seed=seed, pad_to=SAMPLING_PAD, rule=rule)
  tokens = np.array(result.tokens)
  assert tokens.shape == (n_rows, 3)
  assert tokens.min() >= 0 and tokens.max() < v
  counts = np.bincount((tokens[:, 0] * v + tokens[:, 1]) * v + tokens[:, 2], minlength=v ** 3)
  impossible = counts[law.reshape(-1) == 0].sum()
  assert impossible == 0, f"{impossible} rows drew a zero-probability outcome"
  stat, dof, pvalue = pooled_chi_square(counts, law.reshape(-1))
  print(f"\n[{name}, {cfg}] N={n_rows} chi2={stat:.1f} dof={dof} p={pvalue:.3g} "
        f"power(D=0.01)={power(dof, n_rows):.4f} accepted_by_depth="
        f"{result.stats.accepted_by_depth}")
  assert power(dof, n_rows) >= 0.99
  assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} (stat {stat:.1f}, {dof} dof)"

  hist = np.asarray(result.stats.accepted_by_depth)
  if name == "none":
    assert hist.tolist() == [2 * n_rows]
  elif name == "draft_lm_self":  # q == p: accepted with probability exactly 1, one round
    assert hist.tolist() == [0, 0, n_rows]
  else:  # premise: both acceptances and rejections were exercised
    assert hist[0] > 0 and hist[1:].sum() > 0
