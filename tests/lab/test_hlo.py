"""`specjax.lab.hlo.races` on small programs compiled for 2 of the session's CPU devices: a loop
that holds a collective races a collective it is not ordered against by data, and does not race one
whose result it reads or that reads its result; a value the loop only carries through orders
nothing; two plain collectives never race (the runtime orders them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax.lab import hlo

N = 8


@pytest.fixture(scope="module")
def mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))


def _races(mesh, fn) -> list[hlo.Race]:
  """The races of `fn(a, b, n)` (a, b: f32[2N] split over "x"; n: the loop's trip count, traced
  so that the loop stays a loop) run per device under shard_map."""
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P("x"), P()), out_specs=P("x"),
                         check_vma=False)
  args = (jnp.arange(2 * N, dtype=jnp.float32), jnp.ones(2 * N), jnp.int32(3))
  return hlo.races(jax.jit(mapped).lower(*args).compile().as_text())


def _loop(n, v, extra=None):
  """A loop whose every iteration all-reduces its carry (plus `extra` when given)."""
  def body(_, v):
    return jax.lax.psum(v if extra is None else v + extra, "x") * 0.5
  return jax.lax.fori_loop(0, n, body, v)


def _gather(b):
  return jax.lax.all_gather(b, "x", tiled=True)[:N]


def test_an_unordered_collective_races_the_loop(mesh):
  found = _races(mesh, lambda a, b, n: _loop(n, a) + _gather(b))
  assert len(found) == 1, found
  kinds = {found[0].first.split()[0], found[0].second.split()[0]}
  assert kinds == {"while", "all-gather"}, found
  assert "no data path" in str(found[0])


def test_a_loop_that_reads_the_collective_is_ordered(mesh):
  assert _races(mesh, lambda a, b, n: _loop(n, a, extra=_gather(b))) == []


def test_a_collective_that_reads_the_loop_is_ordered(mesh):
  assert _races(mesh, lambda a, b, n: _gather(_loop(n, a) + b)) == []


def test_a_value_the_loop_carries_through_orders_nothing(mesh):
  def fn(a, b, n):
    g = _gather(b)

    def body(_, carry):
      v, kept = carry
      return jax.lax.psum(v, "x") * 0.5, kept
    v, kept = jax.lax.fori_loop(0, n, body, (a, g))
    return v + kept
  assert len(_races(mesh, fn)) == 1


def test_plain_collectives_do_not_race(mesh):
  assert _races(mesh, lambda a, b, n: jax.lax.psum(a, "x") + _gather(b)) == []


def test_parse_reads_operands_and_called_computations(mesh):
  mapped = jax.shard_map(lambda a, b, n: _loop(n, a), mesh=mesh, in_specs=(P("x"), P("x"), P()),
                         out_specs=P("x"), check_vma=False)
  text = jax.jit(mapped).lower(jnp.zeros(2 * N), jnp.zeros(2 * N), jnp.int32(2)).compile().as_text()
  computations = hlo.parse(text)
  loops = [i for insts in computations.values() for i in insts.values() if i.opcode == "while"]
  assert loops and all(set(i.called) == {"body", "condition"} for i in loops)
  body = computations[loops[0].called["body"][0]]
  assert any(i.opcode == "all-reduce" for i in body.values())
  assert all(c in computations for i in loops for c in i.called["body"] + i.called["condition"])
