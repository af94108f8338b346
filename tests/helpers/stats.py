"""The statistics shared by the sampling tests: Pearson chi-square against an exact law."""

from __future__ import annotations

import numpy as np
import scipy.stats


def pooled_chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
  """Pearson chi-square of `counts` against the exact law `probs` over its support.

  Cells with expected count < 5 are pooled into one (merged into the smallest cell if the pool is
  itself < 5): unpooled tests raise false alarms. Returns (statistic, dof, p-value).
  """
  n = counts.sum()
  support = probs > 0
  exp, obs = n * probs[support], counts[support].astype(np.float64)
  big = exp >= 5
  cells_e, cells_o = list(exp[big]), list(obs[big])
  if (~big).any():
    pooled_e, pooled_o = exp[~big].sum(), obs[~big].sum()
    if pooled_e >= 5 or not cells_e:
      cells_e.append(pooled_e)
      cells_o.append(pooled_o)
    else:
      j = int(np.argmin(cells_e))
      cells_e[j] += pooled_e
      cells_o[j] += pooled_o
  e, o = np.array(cells_e), np.array(cells_o)
  stat = float(np.sum((o - e) ** 2 / e))
  dof = len(e) - 1
  return stat, dof, float(scipy.stats.chi2.sf(stat, dof))
