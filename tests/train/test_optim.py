"""The optimiser: frozen leaves stay put and stay out of the clipped gradient norm."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.train.optim import OptimConfig, make_optimizer

_CFG = OptimConfig(learning_rate=0.1, warmup_steps=1, total_steps=10, weight_decay=0.5,
                   clip_norm=1.0)


def test_frozen_leaves_get_no_update_and_no_share_of_the_clip():
  params = {"body": jnp.ones((2, 3)), "head": jnp.ones((3, 4))}
  grads = {"body": jnp.full((2, 3), 0.1), "head": jnp.full((3, 4), 100.0)}
  tx = make_optimizer(_CFG, lambda p: {"body": False, "head": True})
  state = tx.init(params)
  alone = make_optimizer(_CFG)  # the same chain over the body alone
  alone_state = alone.init({"body": params["body"]})
  for _ in range(3):
    updates, state = tx.update(grads, state, params)
    ref, alone_state = alone.update({"body": grads["body"]}, alone_state, {"body": params["body"]})
    # Weight decay would move the head too: a frozen leaf's update is exactly zero.
    np.testing.assert_array_equal(updates["head"], np.zeros((3, 4)))
    # The head's huge gradient would dominate a shared clip norm: the body's step is unaffected.
    np.testing.assert_allclose(updates["body"], ref["body"], rtol=1e-6)
    params = {"body": params["body"] + updates["body"], "head": params["head"]}
  assert not np.allclose(params["body"], 1.0)  # the body did train (warmup starts at lr 0)
