"""Fixed-shape draft trees: the `Tree` pytree, its derived attention masks, and static templates.

A draft tree hangs below the *root*, the last emitted token (`pending` in specjax.decoding), whose
KV is not in the cache yet. A verification round feeds the block `[root | node 0 .. node N-1]`:
block row 0 is the root at position `length`, block row i + 1 is node i at `length + depth[i]`.

Nodes are topologically ordered (a parent precedes its children) and siblings appear in the order
they should be tried by the acceptance rule (specjax.verify). Shapes are static; what varies from
round to round is carried in `valid`. A chain is the tree whose parent is i - 1.

`TreeTemplate` is the static shape of a tree (Medusa's "choices", Cai et al. 2024): a list of paths
of ranks, e.g. `(0, 1)` = the rank-1 candidate below the rank-0 child of the root. A drafter fills a
template with tokens (its rank-r candidate under each parent) to get a `Tree`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Tree:
  """A batch of draft trees with N nodes each (N may be 0: autoregressive decoding)."""

  tokens: jax.Array  # int32[B, N]   drafted token of each node
  parent: jax.Array  # int32[B, N]   parent node index in [0, N); -1 = child of the root
  depth: jax.Array  # int32[B, N]    1 for children of the root
  valid: jax.Array  # bool[B, N]     invalid nodes are never tried, accepted nor attended
  # float32[B, N, V]: the full distribution each node's token was *sampled* from; None when the
  # children were chosen deterministically (top-k, n-gram, static table): see specjax.verify.
  q: jax.Array | None = None
  # Static: True when node i is the child of node i - 1 in every row (`chain`, `empty`, a chain
  # template). The accepted path is then the prefix [root, 0, .., n - 1], already where the
  # cache keeps it, so committing a round moves no KV rows (`specjax.decoding`).
  chain: bool = struct.field(pytree_node=False, default=False)

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def num_nodes(self) -> int:
    return self.tokens.shape[1]

  @property
  def vocab_size(self) -> int | None:
    return None if self.q is None else self.q.shape[-1]

  def head(self, n: int) -> Tree:
    """The tree of its first `n` nodes (static n <= N). Parents precede their children, so this
    is a tree again, and verifying it is verifying the whole tree when nodes `>= n` are invalid
    in every row (they are never tried, accepted nor attended)."""
    q = None if self.q is None else self.q[:, :n]
    return Tree(tokens=self.tokens[:, :n], parent=self.parent[:, :n], depth=self.depth[:, :n],
                valid=self.valid[:, :n], q=q, chain=self.chain)

  @classmethod
  def empty(cls, batch: int) -> Tree:
    """The tree with no nodes: verification then samples one token from the target."""
    zeros = jnp.zeros((batch, 0), jnp.int32)
    return cls(tokens=zeros, parent=zeros, depth=zeros, valid=jnp.zeros((batch, 0), bool),
               chain=True)


def chain(tokens: jax.Array, q: jax.Array | None = None, valid: jax.Array | None = None) -> Tree:
  """The chain `tokens: int32[B, G]` (node i is the child of node i - 1), e.g. G sampled drafts."""
  b, g = tokens.shape
  parent = jnp.broadcast_to(jnp.arange(-1, g - 1, dtype=jnp.int32), (b, g))
  depth = jnp.broadcast_to(jnp.arange(1, g + 1, dtype=jnp.int32), (b, g))
  return _make(tokens, parent, depth, q, valid, chain=True)


def is_chain(parent: np.ndarray) -> bool:
  """Whether the static parent array `int[N]` is a chain's (node i the child of node i - 1)."""
  return bool(np.array_equal(parent, np.arange(-1, len(parent) - 1)))


def _make(tokens, parent, depth, q, valid, chain: bool = False) -> Tree:
  tokens = jnp.asarray(tokens, jnp.int32)
  if valid is None:
    valid = jnp.ones(tokens.shape, bool)
  if q is not None:
    q = jnp.asarray(q, jnp.float32)
    if q.shape[:2] != tokens.shape:
      raise ValueError(f"q has shape {q.shape}, expected {tokens.shape + ('V',)}")
  valid = jnp.asarray(valid, bool)
  if valid.shape != tokens.shape:
    raise ValueError(f"valid has shape {valid.shape}, expected {tokens.shape}")
  return Tree(tokens=tokens, parent=jnp.asarray(parent, jnp.int32),
              depth=jnp.asarray(depth, jnp.int32), valid=valid, q=q, chain=chain)


# ------------------------------------------------------------------------------------------------
# Derived masks


def ancestor_mask(tree: Tree) -> jax.Array:
  """bool[B, N, N]: mask[b, i, j] iff node j is an ancestor of node i or i itself.

  Invalid nodes see nothing but themselves. Computed as the reflexive-transitive closure of the
  parent relation by repeated boolean squaring: after k squarings the mask covers ancestors up to
  2^k steps away, and no path is longer than N (ceil(log2 N) matmuls, no sequential scan). A
  chain's closure is a comparison of prefix counts of its invalid nodes.
  """
  b, n = tree.tokens.shape
  eye = jnp.eye(n, dtype=bool)
  if tree.chain:
    # Node i reaches node j < i iff every node in (j, i] is valid (each step up leaves a valid
    # node): the same closure in closed form, with no matmuls on the verify path.
    gaps = jnp.cumsum(~tree.valid, axis=1, dtype=jnp.int32)  # [B, N] invalid nodes up to i
    idx = jnp.arange(n)
    below = idx[:, None] > idx[None, :]  # [i, j]: j < i
    return eye | (below & (gaps[:, :, None] == gaps[:, None, :]))
  edge = tree.parent[:, :, None] == jnp.arange(n, dtype=jnp.int32)  # [B, N, N] i -> parent(i)
  reach = eye | (edge & tree.valid[:, :, None])
  for _ in range(math.ceil(math.log2(n)) if n > 1 else 0):
    r = reach.astype(jnp.float32)
    reach = jnp.einsum("bij,bjk->bik", r, r) > 0
  return jnp.where(tree.valid[:, :, None], reach, eye)


def verify_mask(tree: Tree) -> jax.Array:
  """bool[B, N+1, N+1] attention among the block `[root | nodes]` (keys along the last axis).

  The root sees itself; node i sees the root, its ancestors and itself; an invalid node sees only
  itself (every row keeps one key, so its softmax stays finite).
  """
  b, n = tree.tokens.shape
  root_row = jnp.zeros((b, 1, n + 1), bool).at[:, 0, 0].set(True)
  node_rows = jnp.concatenate([tree.valid[:, :, None], ancestor_mask(tree)], axis=2)
  return jnp.concatenate([root_row, node_rows], axis=1)


def positions_offsets(tree: Tree) -> jax.Array:
  """int32[B, N+1] = [0, depth...]: block row positions relative to the cache length."""
  zeros = jnp.zeros((tree.batch_size, 1), jnp.int32)
  return jnp.concatenate([zeros, tree.depth.astype(jnp.int32)], axis=1)


# ------------------------------------------------------------------------------------------------
# Static templates


Path = tuple[int, ...]


def _check_paths(paths: Sequence[Path]) -> None:
  seen = set()
  for path in paths:
    if not path:
      raise ValueError("empty path: the root is implicit, list only its descendants")
    if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 0 for r in path):
      raise ValueError(f"path {path}: ranks must be integers >= 0")
    if path in seen:
      raise ValueError(f"duplicate path {path}")
    seen.add(path)
  for path in paths:
    if len(path) > 1 and path[:-1] not in seen:
      raise ValueError(f"path {path} has no parent: its prefix {path[:-1]} is missing")


def _frozen(a) -> np.ndarray:
  a = np.asarray(a, np.int32)
  a.setflags(write=False)
  return a


@dataclasses.dataclass(frozen=True)
class TreeTemplate:
  """A static tree shape from Medusa-style paths of ranks; hashable, so a jit static argument.

  Construction validates the paths (non-empty, ranks >= 0, no duplicates, every prefix present)
  and sorts them by (depth, path): parents precede children and siblings come in rank order, so
  the acceptance rule tries the rank-0 candidate first. Equality and hash use `paths` only.
  """

  paths: tuple[Path, ...]
  parent: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)  # int32[N]
  depth: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)  # int32[N]
  rank: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)  # int32[N]

  def __post_init__(self):
    paths = [tuple(p) for p in self.paths]
    _check_paths(paths)
    paths = sorted((tuple(int(r) for r in p) for p in paths), key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    object.__setattr__(self, "paths", tuple(paths))
    object.__setattr__(self, "parent", _frozen([index[p[:-1]] if len(p) > 1 else -1
                                                for p in paths]))
    object.__setattr__(self, "depth", _frozen([len(p) for p in paths]))
    object.__setattr__(self, "rank", _frozen([p[-1] for p in paths]))

  @classmethod
  def from_paths(cls, paths: Iterable[Sequence[int]]) -> TreeTemplate:
    return cls(tuple(tuple(p) for p in paths))

  @classmethod
  def chain(cls, length: int) -> TreeTemplate:
    """`length` nodes, each the rank-0 child of the previous one."""
    return cls(tuple((0,) * d for d in range(1, length + 1)))

  @classmethod
  def full(cls, branching: Sequence[int]) -> TreeTemplate:
    """Top-k expansion: every node at depth d - 1 has branching[d - 1] children (ranks 0..k-1)."""
    if any(k < 1 for k in branching):
      raise ValueError(f"branching factors must be >= 1, got {tuple(branching)}")
    return cls(tuple(p for d in range(1, len(branching) + 1)
                     for p in itertools.product(*(range(k) for k in branching[:d]))))

  @property
  def num_nodes(self) -> int:
    return len(self.paths)

  @property
  def max_depth(self) -> int:
    return max((len(p) for p in self.paths), default=0)

  def tree(self, tokens: jax.Array, q: jax.Array | None = None,
           valid: jax.Array | None = None) -> Tree:
    """Fills the template: `tokens: int32[B, N]` in template order (optional q, valid)."""
    b, n = np.shape(tokens)
    if n != self.num_nodes:
      raise ValueError(f"tokens have {n} nodes, the template has {self.num_nodes}")
    return _make(tokens, jnp.broadcast_to(self.parent, (b, n)),
                 jnp.broadcast_to(self.depth, (b, n)), q, valid, chain=is_chain(self.parent))


# ------------------------------------------------------------------------------------------------
# Host-side validation


def validate(tree: Tree, vocab_size: int | None = None) -> None:
  """Checks a concrete tree on the host; raises ValueError naming the first problem found.

  Checks: field shapes; parents precede children (parent[i] in [-1, i)); depth == parent depth + 1
  (1 under the root); children of invalid nodes are invalid; token ids in [0, V) when V is known
  (from `vocab_size` or q), for every node, since even an invalid node's token is embedded; q, when
  given, is a finite distribution for each valid node that gives its own token probability > 0
  (a token with q(x) = 0 cannot have been sampled from q: the wrong q was passed); a tree marked
  `chain` is one in every row.
  """
  tokens, parent, depth, valid = (np.asarray(a) for a in
                                  (tree.tokens, tree.parent, tree.depth, tree.valid))
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, N], got shape {tokens.shape}")
  for name, a in (("parent", parent), ("depth", depth), ("valid", valid)):
    if a.shape != tokens.shape:
      raise ValueError(f"{name} has shape {a.shape}, tokens have {tokens.shape}")
  if tree.chain and not all(is_chain(row) for row in parent):
    raise ValueError("the tree is marked chain=True but a node's parent is not the node before "
                     "it: committing it would keep the wrong cache rows")
  q = None if tree.q is None else np.asarray(tree.q, np.float64)
  if q is not None and (q.ndim != 3 or q.shape[:2] != tokens.shape):
    raise ValueError(f"q has shape {q.shape}, expected {tokens.shape + ('V',)}")
  if vocab_size is None and q is not None:
    vocab_size = q.shape[-1]
  for b, i in np.ndindex(tokens.shape):
    _check_node(b, i, tokens, parent, depth, valid, vocab_size)
  if q is not None:
    _check_q(q, tokens, valid)


def _check_node(b, i, tokens, parent, depth, valid, vocab_size) -> None:
  where = f"row {b}, node {i}"
  par = int(parent[b, i])
  if not -1 <= par < i:
    raise ValueError(f"{where}: parent {par} does not precede it (need -1 <= parent < {i}); "
                     "nodes must be topologically ordered")
  want = 1 if par < 0 else int(depth[b, par]) + 1
  if depth[b, i] != want:
    raise ValueError(f"{where}: depth {int(depth[b, i])}, expected {want} (parent depth + 1)")
  if valid[b, i] and par >= 0 and not valid[b, par]:
    raise ValueError(f"{where}: valid, but its parent {par} is invalid "
                     "(children of invalid nodes must be invalid)")
  if vocab_size is not None and not 0 <= tokens[b, i] < vocab_size:
    raise ValueError(f"{where}: token id {int(tokens[b, i])} outside [0, {vocab_size})")


def _check_q(q, tokens, valid) -> None:
  if not np.all(np.isfinite(q)) or np.any(q < 0):
    raise ValueError("q has negative or non-finite entries")
  sums = q.sum(-1)
  for b, i in zip(*np.nonzero(valid)):
    if abs(sums[b, i] - 1.0) > 1e-3:
      raise ValueError(f"row {b}, node {i}: q sums to {sums[b, i]:.6f}, not 1")
    if q[b, i, tokens[b, i]] <= 0:
      raise ValueError(f"row {b}, node {i}: token {int(tokens[b, i])} has q = 0, so it cannot "
                       "have been sampled from q")


# ------------------------------------------------------------------------------------------------
# EAGLE-2's dynamic tree


@struct.dataclass
class DynamicTree:
  """A grown tree in draft-vocabulary ids: `tree.tokens` are draft ids, `score` cumulative
  log-probabilities (a node's score is its parent's plus its own draft log-probability)."""

  tree: Tree
  score: jax.Array  # float32[B, N]


def grown_tree_capacity(depth: int, top_k: int) -> int:
  """The most nodes a tree grown level by level (`grow_dynamic_tree`, `tree_from_marginals`)
  can keep: the root's top_k children, then top_k^2 candidates at each further depth."""
  return top_k + (depth - 1) * top_k * top_k


def grow_dynamic_tree(root_logp: jax.Array, expand, carry, *, depth: int, top_k: int,
                      num_nodes: int) -> tuple[DynamicTree, object]:
  """EAGLE-2 (Li et al. 2024): expand the best frontier by cumulative log-probability, then keep
  the best `num_nodes` of everything proposed.

  root_logp: float32[B, V] draft log-probabilities of the root's children.
  expand(carry, tokens, parent, level) -> (logp, carry): runs the drafter on the frontier, the
    `top_k` nodes at depth `level` (int32[B, k] draft ids; `parent[b, i]` is the index of node i's
    parent in the previous frontier, 0 for the root when level == 1), returning float32[B, k, V]
    log-probabilities of their children.

  1. The root's top_k children form the depth-1 frontier.
  2. For levels 1 .. depth - 1: each frontier node proposes its top_k children, scored parent
     score + child log-probability (top_k^2 candidates, all kept); the best top_k of them are the
     next frontier.
  3. The tree is the best `num_nodes` of the top_k + (depth - 1) top_k^2 candidates, in candidate
     order. A child never scores above its parent and ties go to the lower (earlier) candidate,
     so the kept set contains every kept node's parent and parents precede children.

  Shapes are static: a Python loop over `depth` levels with fixed k.
  """
  b = root_logp.shape[0]
  k = top_k
  most = grown_tree_capacity(depth, k)
  if not 1 <= num_nodes <= most:
    raise ValueError(f"num_nodes must be in [1, {most}] for depth {depth} and top_k {k}, "
                     f"got {num_nodes}")
  score, tok = jax.lax.top_k(root_logp.astype(jnp.float32), k)  # [B, k]
  scores, tokens = [score], [tok]
  parents, depths = [jnp.full((b, k), -1, jnp.int32)], [np.ones(k, np.int32)]
  front_score, front_tok = score, tok
  front_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
  front_parent = jnp.zeros((b, k), jnp.int32)
  for level in range(1, depth):
    logp, carry = expand(carry, front_tok, front_parent, level)
    child_lp, child_tok = jax.lax.top_k(logp.astype(jnp.float32), k)  # [B, k, k]
    child_score = (front_score[:, :, None] + child_lp).reshape(b, k * k)
    scores.append(child_score)
    tokens.append(child_tok.reshape(b, k * k))
    parents.append(jnp.repeat(front_cand, k, axis=1))
    depths.append(np.full(k * k, level + 1, np.int32))
    front_score, flat = jax.lax.top_k(child_score, k)
    front_parent = flat // k
    front_tok = jnp.take_along_axis(tokens[-1], flat, axis=1)
    front_cand = (k + (level - 1) * k * k + flat).astype(jnp.int32)
  scores, tokens, parents = (jnp.concatenate(x, axis=1) for x in (scores, tokens, parents))
  depth_all = jnp.asarray(np.concatenate(depths))
  if num_nodes == most:  # every candidate is kept (a chain's nodes, say): nothing to select
    keep = jnp.broadcast_to(jnp.arange(most, dtype=jnp.int32), (b, most))
  else:
    keep = jnp.sort(jax.lax.top_k(scores, num_nodes)[1], axis=1)  # candidate order: parents first
  parent_cand = jnp.take_along_axis(parents, keep, axis=1)
  # Position of each node's parent among the kept candidates (-1 under the root).
  match = keep[:, None, :] == parent_cand[:, :, None]  # [B, N, N]
  parent = jnp.where(parent_cand < 0, -1, jnp.argmax(match, axis=-1)).astype(jnp.int32)
  # With one child per node the kept nodes are a prefix of the one path grown (scores only fall).
  tree = _make(jnp.take_along_axis(tokens, keep, axis=1), parent, depth_all[keep], None, None,
               chain=k == 1 or num_nodes == 1)
  return DynamicTree(tree, jnp.take_along_axis(scores, keep, axis=1)), carry


# ------------------------------------------------------------------------------------------------
# Trees from per-depth marginals (parallel drafters)


def tree_from_marginals(logp: jax.Array, *, num_nodes: int, top_k: int | None = None
                        ) -> DynamicTree:
  """The best `num_nodes`-node tree from the per-depth marginals of one parallel draft pass
  (DFlash and kin): DDTree's best-first tree (Ringel et al. 2026) with static shapes.

  logp: float32[B, D, V] log-probabilities of the token at depth d + 1 below the root, each
    depth's distribution independent of the tokens above it (a block drafted in one pass).

  A node is a path of ranks (r_1, ..., r_d) below the root, holding the rank-r_d token of depth
  d; its score is the sum of its tokens' log-probabilities (the product of marginals). Scores
  fall along both a path and a sibling list, so the `num_nodes` best nodes form a prefix-closed
  tree, and the best-first heap that pops a node and pushes its next sibling and first child
  keeps exactly them. Here the same set is taken level by level (`grow_dynamic_tree` with every
  node expanded by the same depth marginal): the best `top_k` nodes of each depth are kept as
  the frontier and the tree is the best `num_nodes` of all candidates. With top_k >= num_nodes
  (the default: top_k = min(num_nodes, V)) nothing of the best-first tree is ever cut, since no
  depth holds more than `num_nodes` of its nodes; a smaller top_k trades that for a cheaper
  selection. top_k = 1 with num_nodes = D is the chain of per-depth argmaxes, which is what the
  DFlash reference verifies.

  Children are the top-ranked tokens of deterministic scores, never samples: the tree needs no
  q (`Tree.q` is None) and recursive rejection against the target's own distribution keeps any
  temperature's output law exact.
  """
  b, d, v = logp.shape
  k = min(num_nodes, v) if top_k is None else top_k
  if not 1 <= k <= v:
    raise ValueError(f"top_k must be in [1, {v}] (the vocabulary the marginals cover), got {k}")
  if not 1 <= num_nodes <= grown_tree_capacity(d, k):
    raise ValueError(f"num_nodes must be in [1, {grown_tree_capacity(d, k)}] for depth {d} "
                     f"and top_k {k}, got {num_nodes}")
  logp = logp.astype(jnp.float32)

  def expand(carry, tokens, parent, level):  # every frontier node reads the next depth's marginal
    return jnp.broadcast_to(logp[:, level][:, None], (b, tokens.shape[1], v)), carry

  grown, _ = grow_dynamic_tree(logp[:, 0], expand, (), depth=d, top_k=k, num_nodes=num_nodes)
  return grown
