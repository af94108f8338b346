"""`specjax.metrics`: the figures every report (Stats, the benchmark) computes the same way."""

from __future__ import annotations

import json
import math

from specjax import metrics


def test_acceptance_by_depth_is_conditional_on_the_parent():
  # 4 rounds: 1 accepted nothing, 2 accepted one node, 1 accepted two, none accepted three.
  assert metrics.acceptance_by_depth([1, 2, 1, 0]) == [0.75, 1 / 3, 0.0]
  assert metrics.acceptance_by_depth([0, 0, 0, 6]) == [1.0, 1.0, 1.0]
  assert metrics.acceptance_by_depth([5]) == []  # autoregressive: no draft depth


def test_unreached_depths():
  """A depth whose parent was never accepted has no rate: None (valid JSON) or what is asked."""
  alpha = metrics.acceptance_by_depth([4, 0, 0])
  assert alpha == [0.0, None]
  json.dumps(alpha, allow_nan=False)
  assert math.isnan(metrics.acceptance_by_depth([4, 0, 0], unreached=float("nan"))[1])


def test_tau():
  assert metrics.tau(128, 128) == 1.0
  assert metrics.tau(128, 23) == 128 / 23
