"""Lossless acceptance of a draft tree: one scan implements greedy, chains and trees.

The rule is recursive rejection sampling (SpecInfer, Miao et al. 2024; for a single chain it is
Leviathan et al. 2023 / Chen et al. 2023). Walking the tree from the root, with `r` the current
*residual* target distribution (p at the current node to start with):

  * try the current node's children in order; child i carries token x drawn from q_i (one-hot at x
    when the child was chosen deterministically: top-k, n-gram, a static table);
  * accept it with probability min(1, r(x) / q_i(x))  -- i.e. iff u * q_i(x) < r(x), u ~ U[0, 1);
  * on acceptance move to the child: r = p at the child, and try its children;
  * on rejection r = normalize(max(r - q_i, 0)) and try the next sibling. For a one-hot q_i this
    is "set r(x) = 0 and renormalise" (recursive rejection over deterministic children); for
    i.i.d. sampled siblings it is SpecInfer's multi-round rule;
  * when no child is accepted, emit a bonus token drawn from r.

Why it is lossless: if x ~ q, then P(emit y at this step) = min(q(y), r(y)) + P(reject) *
residual(y) = min(q, r)(y) + max(r - q, 0)(y) = r(y). By induction over siblings (each q_i may
depend on the earlier siblings' tokens, never on the uniforms) and over depth, each emitted token
follows the target's conditional law. Greedy decoding is the same algorithm with one-hot p
(target_probs with temperature 0): the child equal to the argmax is accepted with probability 1,
others with 0, and the bonus is the argmax.

Because nodes are topologically ordered, the children of the current node always come after it, and
siblings of an accepted node (a different parent) are skipped: one pass over the nodes in index
order visits exactly the trials of the tree walk.

Numerics: the residual is carried normalised (renormalised once per rejection) so that the first
trial below a node compares u * q(x) < p(x) directly: with q == p bitwise, acceptance is certain
for every u < 1, not merely up to the rounding of sum(p). No step divides by q(x).

Block rows: row 0 is the root (pending token), row i + 1 is node i; p[:, row] is the target's
distribution for the token *after* that row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import trees
from specjax.sampling import SamplingConfig, argmax, row_keys, target_probs
from specjax.trees import Tree

# A residual whose mass sum(max(r - q, 0)) is at most this is rounding noise of r - q (the
# distributions agree to float32 precision); it is replaced by the target distribution at the
# current node. The rejection that produced it had probability about that mass, so the output law
# moves by at most ~1e-7 in total variation, and no 0 / 0 can ever occur.
EMPTY_MASS = float(jnp.finfo(jnp.float32).eps)


@struct.dataclass
class Acceptance:
  """Result of verifying one draft tree per row; commit `path[:n_accepted + 1]`, emit `tokens`."""

  n_accepted: jax.Array  # int32[B]        draft nodes accepted (0 .. max depth)
  path: jax.Array  # int32[B, N+1]         block rows to keep: root 0, accepted rows, 0-padding
  tokens: jax.Array  # int32[B, N+1]       accepted tokens, then the bonus at n_accepted; 0-padded
  accepted_node: jax.Array  # bool[B, N]   nodes on the accepted path


def acceptance_probability(p: jax.Array, q: jax.Array) -> jax.Array:
  """P(accept a draft x ~ q against target p) = sum_x q(x) min(1, p(x)/q(x)) = sum min(p, q)."""
  return jnp.sum(jnp.minimum(p, q), axis=-1)


def try_node(r: jax.Array, token: jax.Array, q: jax.Array, u: jax.Array):
  """One trial of recursive rejection sampling (module docstring).

  r: float32[V] the current residual, normalised; token: int32[] the node's token x;
  q: float32[V] the distribution x was drawn from (one-hot at x for a deterministic child);
  u: float32[] a fresh uniform in [0, 1).

  Returns (accepted: bool[], rejected_residual: float32[V]) where accepted = u q(x) < r(x) (this
  never divides, so q(x) = 0 is safe: accept iff r(x) > 0) and rejected_residual = max(r - q, 0),
  unnormalised: its mass is exactly the rejection probability 1 - sum min(r, q).
  """
  accepted = u * q[token] < r[token]
  return accepted, jnp.maximum(r - q, 0.0)


def _renormalise(residual: jax.Array, fallback: jax.Array) -> jax.Array:
  """residual / sum(residual), or `fallback` when the residual is numerically empty."""
  mass = jnp.sum(residual)
  return jnp.where(mass > EMPTY_MASS, residual / jnp.maximum(mass, EMPTY_MASS), fallback)


def _walk_row(p, tokens, parent, valid, q, uniforms):
  """The scan over one row's nodes. p: [N+1, V]; tokens, parent, valid, uniforms: [N];
  q: [N, V] or None (deterministic children). Returns (accepted bool[N], cur int32[], r [V])."""
  v = p.shape[-1]

  def step(carry, node):
    cur, r = carry  # cur: block row of the deepest accepted node (0 = root)
    i, token, par, ok, q_i, u = node
    if q_i is None:  # a deterministic child is a draft with one-hot q
      q_i = jax.nn.one_hot(token, v, dtype=jnp.float32)
    tried = ok & (par + 1 == cur)  # block row of the parent is parent + 1 (root: -1 + 1 = 0)
    hit, residual = try_node(r, token, q_i, u)
    accepted = tried & hit
    r = jnp.where(accepted, p[i + 1], jnp.where(tried, _renormalise(residual, p[cur]), r))
    return (jnp.where(accepted, i + 1, cur), r), accepted

  nodes = (jnp.arange(tokens.shape[0], dtype=jnp.int32), tokens, parent, valid, q, uniforms)
  (cur, r), accepted = jax.lax.scan(step, (jnp.int32(0), p[0]), nodes)
  return accepted, cur, r


def walk(tree: Tree, p: jax.Array, uniforms: jax.Array):
  """The acceptance walk with injected uniforms (white-box entry point).

  p: float32[B, N+1, V] target distributions per block row; uniforms: float32[B, N], one per node
  (used only if the node is tried). Returns (accepted_node bool[B, N], cur int32[B] the block row
  of the last accepted node, residual float32[B, V] normalised: the bonus token's distribution).
  """
  q = None if tree.q is None else tree.q.astype(jnp.float32)
  return jax.vmap(_walk_row)(p.astype(jnp.float32), tree.tokens, tree.parent, tree.valid, q,
                             uniforms.astype(jnp.float32))


def draw_bonus(residual: jax.Array, keys: jax.Array, greedy: bool) -> jax.Array:
  """int32[B] bonus tokens from residual: float32[B, V] (argmax when greedy; one key per row).

  Sampling uses log(residual) as logits: zero-probability ids get -inf and can never be drawn, and
  every id is < V by construction.
  """
  if greedy:
    return argmax(residual)
  return jax.vmap(jax.random.categorical)(keys, jnp.log(residual)).astype(jnp.int32)


def _assemble(tokens: jax.Array, accepted: jax.Array, bonus: jax.Array, *,
              chain: bool = False) -> Acceptance:
  """Packs the accepted nodes (a root-to-leaf chain, hence in index order) and the bonus. In a
  chain (`Tree.chain`) the accepted nodes are already the first ones."""
  b, n = tokens.shape
  n_acc = jnp.sum(accepted, axis=-1, dtype=jnp.int32)
  if chain:  # no sort, and no gather of the tokens into the order they already have
    order, picked = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), tokens
  else:  # accepted node indices first, in order
    order = jnp.argsort(~accepted, axis=-1, stable=True)
    picked = jnp.take_along_axis(tokens, order, axis=-1)
  on_path = jnp.arange(n)[None, :] < n_acc[:, None]
  rows = jnp.where(on_path, order + 1, 0).astype(jnp.int32)
  toks = jnp.where(on_path, picked, 0).astype(jnp.int32)
  toks = jnp.concatenate([toks, jnp.zeros((b, 1), jnp.int32)], axis=1)
  return Acceptance(
      n_accepted=n_acc,
      path=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), rows], axis=1),
      tokens=toks.at[jnp.arange(b), n_acc].set(bonus),
      accepted_node=accepted,
  )


def accept_with_uniforms(tree: Tree, p: jax.Array, uniforms: jax.Array, bonus_key: jax.Array,
                         *, greedy: bool = False) -> Acceptance:
  """`accept` with the target distributions p: float32[B, N+1, V] and the accept uniforms
  float32[B, N] given; the bonus is drawn with row_keys(bonus_key, B) (or argmax when greedy)."""
  _check_shapes(tree, p)
  accepted, _, residual = walk(tree, p, uniforms)
  bonus = draw_bonus(residual, row_keys(bonus_key, tree.batch_size), greedy)
  return _assemble(tree.tokens, accepted, bonus, chain=tree.chain)


@jax.jit
def accept(tree: Tree, logits: jax.Array, sampling: SamplingConfig, rng: jax.Array) -> Acceptance:
  """Verifies `tree` against the target's logits: float[B, N+1, V] (row 0 at the root, row i + 1
  at node i) under `sampling` (temperature / top-k / top-p applied to the target, greedy = T 0;
  a pytree whose mode is static and whose temperature and top-p are traced).

  Randomness: rng splits into an accept key and a bonus key (a uniform is never reused for both
  the accept test and the residual draw); each batch row folds in its index (row_keys), so a row's
  draws do not depend on the batch size, and draws one uniform per node.
  """
  _check_shapes(tree, logits)
  if sampling.greedy:
    return accept_greedy(tree, logits)
  p = target_probs(logits, sampling)
  b, n = tree.tokens.shape
  accept_key, bonus_key = jax.random.split(rng)
  uniforms = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(row_keys(accept_key, b))
  return accept_with_uniforms(tree, p, uniforms, bonus_key, greedy=sampling.greedy)


def accept_greedy(tree: Tree, logits: jax.Array) -> Acceptance:
  """The walk above when p is one-hot at the target's argmax, without the scan over nodes.

  With a one-hot residual r, trying child x accepts iff x == argmax (u * 1 < 1 for any u < 1,
  u * 1 < 0 never) and a rejection leaves r unchanged (max(r - onehot(x), 0) = r for x !=
  argmax). So a node is accepted iff every node on its path, itself included, is the first of its
  siblings whose token is the argmax at its parent's row: a mask computation over the tree in
  one shot (tests check it against the scan on random trees, duplicates and invalid nodes).
  """
  b, n = tree.tokens.shape
  want = argmax(logits)  # [B, N+1] argmax after each block row
  if tree.chain:  # node i's parent row is row i; the accepted nodes are the matching prefix
    accepted = jnp.cumprod(tree.valid & (tree.tokens == want[:, :n]), axis=1).astype(bool)
    bonus = jnp.take_along_axis(want, jnp.sum(accepted, axis=1)[:, None], axis=1)[:, 0]
    return _assemble(tree.tokens, accepted, bonus, chain=True)
  match = tree.valid & (tree.tokens == jnp.take_along_axis(want, tree.parent + 1, axis=1))
  idx = jnp.arange(n)
  earlier_sibling = ((tree.parent[:, :, None] == tree.parent[:, None, :])
                     & (idx[None, None, :] < idx[None, :, None]))  # [B, i, j]: j < i, same parent
  first = match & ~jnp.any(earlier_sibling & match[:, None, :], axis=-1)
  accepted = ~jnp.any(trees.ancestor_mask(tree) & ~first[:, None, :], axis=-1)
  # The deepest accepted node has the largest index on the (single) accepted path.
  cur = jnp.max(jnp.where(accepted, idx[None, :] + 1, 0), axis=-1, initial=0)
  bonus = jnp.take_along_axis(want, cur[:, None], axis=1)[:, 0]
  return _assemble(tree.tokens, accepted, bonus)


def _check_shapes(tree: Tree, x: jax.Array) -> None:
  b, n = tree.tokens.shape
  if x.ndim != 3 or x.shape[:2] != (b, n + 1):
    raise ValueError(f"target rows have shape {x.shape}, expected ({b}, {n + 1}, V) for a tree "
                     f"of {n} nodes (row 0 is the root)")
  if tree.q is not None and tree.q.shape[-1] != x.shape[-1]:
    raise ValueError(f"draft q has vocab {tree.q.shape[-1]}, the target has {x.shape[-1]}")
