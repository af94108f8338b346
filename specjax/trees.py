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

from specjax.children import TOP_K, Children, pick
from specjax.sampling import GREEDY, SamplingConfig


@struct.dataclass
class DraftDist:
  """The distributions a tree's sampled nodes were drawn from: one row per expanded parent.

  Siblings share their parent's row, so the memory is P rows of the drafter's own vocabulary,
  not one target-vocabulary row per node: float32 P x Vq x 4 bytes per batch row. For a
  128k-token vocabulary and a 64-node tree that is 64 x 128256 x 4 = 32.8 MB per row if every
  node had its own; EAGLE-2's tree of depth 6 and top_k 4 expands at most 21 parents (10.8 MB
  over 128k ids, 2.7 MB over EAGLE-3's 32k draft ids), a static template one per parent node.
  """

  probs: jax.Array  # float32[B, P, Vq]  q at each of P parents, over the drafter's ids
  source: jax.Array  # int32[B, N]  the row of `probs` node i was drawn from
  # int32[B, Vq]: the target id of each entry of a row (a reduced draft vocabulary, plus any
  # ids the round adds); target ids outside it have q = 0. None: rows are over target ids.
  ids: jax.Array | None = None
  # Static: sibling i was drawn from its row with the tokens of its earlier siblings removed and
  # renormalised (sampling without replacement); False: every sibling from the row itself.
  without_replacement: bool = struct.field(pytree_node=False, default=False)
  # Static: how many children each node has depends on nothing drawn at or below those children
  # (a template's shape, a chain, a tree grown from token-free marginals); False where a node
  # keeps a child or not by what its earlier children drew below them (EAGLE-2's pruned tree,
  # `grow_dynamic_tree`). K-SEQ (`specjax.verify.Rule`) needs it; recursive rejection does not.
  counts_fixed: bool = struct.field(pytree_node=False, default=True)

  @property
  def num_rows(self) -> int:
    return self.probs.shape[1]

  def row_q(self, vocab_size: int) -> jax.Array:
    """float32[B, P, V] the rows over the target's vocabulary (zeros outside `ids`)."""
    probs = self.probs.astype(jnp.float32)
    if self.ids is None:
      return probs
    b, p, _ = probs.shape
    full = jnp.zeros((b, p, vocab_size), jnp.float32)
    return jax.vmap(lambda f, i, q: f.at[:, i].add(q))(full, self.ids, probs)


@struct.dataclass
class Tree:
  """A batch of draft trees with N nodes each (N may be 0: autoregressive decoding)."""

  tokens: jax.Array  # int32[B, N]   drafted token of each node
  parent: jax.Array  # int32[B, N]   parent node index in [0, N); -1 = child of the root
  depth: jax.Array  # int32[B, N]    1 for children of the root
  valid: jax.Array  # bool[B, N]     invalid nodes are never tried, accepted nor attended
  # The distributions the nodes' tokens were *sampled* from; None when the children were chosen
  # deterministically (top-k, n-gram, static table): see specjax.verify.
  draft: DraftDist | None = None
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
  def sampled(self) -> bool:
    return self.draft is not None

  def node_q(self, vocab_size: int) -> jax.Array | None:
    """float32[B, N, V]: the distribution each node's token was drawn from, over the target's
    vocabulary (without replacement: its row with the earlier siblings' tokens removed and
    renormalised); None for deterministic children. For checks and tests: verification reads
    the rows themselves."""
    if self.draft is None:
      return None
    rows = self.draft.row_q(vocab_size)
    q = jnp.take_along_axis(rows, self.draft.source[:, :, None], axis=1)
    if not self.draft.without_replacement:
      return q
    n = self.num_nodes
    idx = jnp.arange(n)
    earlier = ((self.parent[:, :, None] == self.parent[:, None, :])
               & (idx[None, None, :] < idx[None, :, None]))  # [B, i, j] j an earlier sibling
    drawn = jnp.einsum("bij,bjv->biv", earlier.astype(jnp.float32),
                       jax.nn.one_hot(self.tokens, vocab_size, dtype=jnp.float32)) > 0
    q = jnp.where(drawn, 0.0, q)
    return q / jnp.maximum(q.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)

  def head(self, n: int) -> Tree:
    """The tree of its first `n` nodes (static n <= N). Parents precede their children, so this
    is a tree again, and verifying it is verifying the whole tree when nodes `>= n` are invalid
    in every row (they are never tried, accepted nor attended)."""
    draft = None if self.draft is None else self.draft.replace(source=self.draft.source[:, :n])
    return Tree(tokens=self.tokens[:, :n], parent=self.parent[:, :n], depth=self.depth[:, :n],
                valid=self.valid[:, :n], draft=draft, chain=self.chain)

  @classmethod
  def empty(cls, batch: int) -> Tree:
    """The tree with no nodes: verification then samples one token from the target."""
    zeros = jnp.zeros((batch, 0), jnp.int32)
    return cls(tokens=zeros, parent=zeros, depth=zeros, valid=jnp.zeros((batch, 0), bool),
               chain=True)


def per_node(q: jax.Array) -> DraftDist:
  """The draft distributions of a tree whose every node has its own q: float32[B, N, V] over
  target ids (a chain of sampled drafts: each node is the only child of its parent)."""
  q = jnp.asarray(q, jnp.float32)
  b, n = q.shape[:2]
  return DraftDist(probs=q, source=jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))


def chain(tokens: jax.Array, q: jax.Array | None = None, valid: jax.Array | None = None) -> Tree:
  """The chain `tokens: int32[B, G]` (node i is the child of node i - 1), e.g. G sampled drafts."""
  b, g = tokens.shape
  parent = jnp.broadcast_to(jnp.arange(-1, g - 1, dtype=jnp.int32), (b, g))
  depth = jnp.broadcast_to(jnp.arange(1, g + 1, dtype=jnp.int32), (b, g))
  return _make(tokens, parent, depth, q, valid, chain=True)


def is_chain(parent: np.ndarray) -> bool:
  """Whether the static parent array `int[N]` is a chain's (node i the child of node i - 1)."""
  return bool(np.array_equal(parent, np.arange(-1, len(parent) - 1)))


def _make(tokens, parent, depth, q, valid, chain: bool = False, draft=None) -> Tree:
  tokens = jnp.asarray(tokens, jnp.int32)
  if valid is None:
    valid = jnp.ones(tokens.shape, bool)
  if q is not None:
    if draft is not None:
      raise ValueError("pass q (one distribution per node) or draft, not both")
    q = jnp.asarray(q, jnp.float32)
    if q.shape[:2] != tokens.shape:
      raise ValueError(f"q has shape {q.shape}, expected {tokens.shape + ('V',)}")
    draft = per_node(q)
  if draft is not None and draft.source.shape != tokens.shape:
    raise ValueError(f"draft.source has shape {draft.source.shape}, expected {tokens.shape}")
  valid = jnp.asarray(valid, bool)
  if valid.shape != tokens.shape:
    raise ValueError(f"valid has shape {valid.shape}, expected {tokens.shape}")
  return Tree(tokens=tokens, parent=jnp.asarray(parent, jnp.int32),
              depth=jnp.asarray(depth, jnp.int32), valid=valid, draft=draft, chain=chain)


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
  # int32[N]: the node's place among its parent's children (0 for the first), which sampled
  # children follow instead of the rank: the i-th child of a parent is its i-th draw.
  sibling: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)

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
    seen: dict[Path, int] = {}
    sibling = []
    for p in paths:
      sibling.append(seen.get(p[:-1], 0))
      seen[p[:-1]] = sibling[-1] + 1
    object.__setattr__(self, "sibling", _frozen(sibling))

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
           valid: jax.Array | None = None, draft: DraftDist | None = None) -> Tree:
    """Fills the template: `tokens: int32[B, N]` in template order (optional valid, and the
    distributions of sampled tokens: q per node, or `draft` rows)."""
    b, n = np.shape(tokens)
    if n != self.num_nodes:
      raise ValueError(f"tokens have {n} nodes, the template has {self.num_nodes}")
    return _make(tokens, jnp.broadcast_to(self.parent, (b, n)),
                 jnp.broadcast_to(self.depth, (b, n)), q, valid, chain=is_chain(self.parent),
                 draft=draft)


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
  draft = tree.draft
  if draft is not None:
    probs = np.asarray(draft.probs)
    if probs.ndim != 3 or probs.shape[0] != tokens.shape[0]:
      raise ValueError(f"draft.probs has shape {probs.shape}, expected {(tokens.shape[0],)} + "
                       "(P, Vq)")
    if np.asarray(draft.source).shape != tokens.shape:
      raise ValueError(f"draft.source has shape {np.asarray(draft.source).shape}, tokens have "
                       f"{tokens.shape}")
    if vocab_size is None:
      vocab_size = probs.shape[-1] if draft.ids is None else int(np.max(draft.ids)) + 1
  for b, i in np.ndindex(tokens.shape):
    _check_node(b, i, tokens, parent, depth, valid, vocab_size)
  if draft is not None:
    _check_draft(tree, vocab_size, valid)


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


def _check_draft(tree: Tree, vocab_size: int | None, valid: np.ndarray) -> None:
  draft = tree.draft
  probs, source = np.asarray(draft.probs, np.float64), np.asarray(draft.source)
  if not np.all(np.isfinite(probs)) or np.any(probs < 0):
    raise ValueError("q has negative or non-finite entries")
  rows = probs.shape[1]
  if np.any(valid & ((source < 0) | (source >= rows))):
    raise ValueError(f"draft.source holds a row outside [0, {rows})")
  if draft.ids is not None:
    ids = np.asarray(draft.ids)
    want = (probs.shape[0], probs.shape[2])
    if ids.shape != want:
      raise ValueError(f"draft.ids has shape {ids.shape}, expected {want}")
    if ids.min() < 0 or ids.max() >= vocab_size:
      raise ValueError(f"draft.ids hold ids outside [0, {vocab_size})")
  sums = probs.sum(-1)
  q = np.asarray(tree.node_q(vocab_size), np.float64)
  tokens = np.asarray(tree.tokens)
  for b, i in zip(*np.nonzero(valid)):
    if abs(sums[b, source[b, i]] - 1.0) > 1e-3:
      raise ValueError(f"row {b}, node {i}: q sums to {sums[b, source[b, i]]:.6f}, not 1")
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


def grown_counts_fixed(depth: int, top_k: int, num_nodes: int) -> bool:
  """Whether a tree grown with these options (`grow_dynamic_tree`) fixes each node's number of
  children before they are drawn, whatever the drafter reads (`DraftDist.counts_fixed`): with
  one child per node (a chain), or when every candidate is kept (a node then has top_k children
  if its slot made its level's frontier, none otherwise, decided by the scores above it). A
  pruned tree does not: a parent's later slot is kept only if fewer candidates beat it, and the
  descendants of its earlier children, scored by the q their own tokens gave, are among them."""
  return top_k == 1 or num_nodes == grown_tree_capacity(depth, top_k)


def grow_dynamic_tree(root_logp: jax.Array, expand, carry, *, depth: int, top_k: int,
                      num_nodes: int, children: Children = TOP_K,
                      sampling: SamplingConfig = GREEDY, key: jax.Array | None = None
                      ) -> tuple[DynamicTree, object]:
  """EAGLE-2 (Li et al. 2024): expand the best frontier by cumulative log-probability, then keep
  the best `num_nodes` of everything proposed.

  root_logp: float32[B, V] draft log-probabilities of the root's children.
  expand(carry, tokens, parent, level) -> (logp, carry): runs the drafter on the frontier, the
    `top_k` nodes at depth `level` (int32[B, k] draft ids; `parent[b, i]` is the index of node i's
    parent in the previous frontier, 0 for the root when level == 1), returning float32[B, k, V]
    log-probabilities of their children.
  children, sampling, key: how each expanded node's k children are picked (`specjax.children`):
    its top-k (the default), or k draws from q (at a temperature > 0; `key` then required), the
    tree then carrying one q row per expanded parent (`DraftDist`).

  1. The root's top_k children form the depth-1 frontier.
  2. For levels 1 .. depth - 1: each frontier node proposes top_k children, scored parent
     score + child score (top_k^2 candidates, all kept); the best top_k of them are the next
     frontier.
  3. The tree is the best `num_nodes` of the top_k + (depth - 1) top_k^2 candidates, in candidate
     order. A child never scores above its parent and ties go to the lower (earlier) candidate,
     so the kept set contains every kept node's parent and parents precede children.

  A child's score is its log-probability for top-k children, its slot's (the i-th largest log q
  for a parent's i-th draw, never its own token's: `specjax.children`) for sampled ones; those
  whose slot holds no token (q's support exhausted without replacement) are invalid, as are
  their descendants (they score -inf). The draft rows record whether the tree fixed each node's
  number of children before drawing them (`grown_counts_fixed`; `tree_from_marginals`, whose
  drafter reads no tokens, always does).

  Shapes are static: a Python loop over `depth` levels with fixed k.
  """
  b = root_logp.shape[0]
  k = top_k
  most = grown_tree_capacity(depth, k)
  if not 1 <= num_nodes <= most:
    raise ValueError(f"num_nodes must be in [1, {most}] for depth {depth} and top_k {k}, "
                     f"got {num_nodes}")
  sampled = children.used(sampling) != "top_k"
  if sampled and key is None:
    raise ValueError("sampled children need a key")
  keys = jax.random.split(key, depth) if sampled else [None] * depth
  picked = pick(children, sampling, keys[0], root_logp[:, None], k)
  score, tok = picked.scores[:, 0], picked.tokens[:, 0]  # [B, k]
  scores, tokens = [score], [tok]
  rows, cand_rows = [picked.q], [np.zeros(k, np.int32)]  # q rows; the row each candidate used
  parents, depths = [jnp.full((b, k), -1, jnp.int32)], [np.ones(k, np.int32)]
  front_score, front_tok = score, tok
  front_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
  front_parent = jnp.zeros((b, k), jnp.int32)
  for level in range(1, depth):
    logp, carry = expand(carry, front_tok, front_parent, level)
    picked = pick(children, sampling, keys[level], logp, k)  # [B, k, k]
    child_score = (front_score[:, :, None] + picked.scores).reshape(b, k * k)
    scores.append(child_score)
    tokens.append(picked.tokens.reshape(b, k * k))
    rows.append(picked.q)
    cand_rows.append(1 + (level - 1) * k + np.repeat(np.arange(k, dtype=np.int32), k))
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
  kept_scores = jnp.take_along_axis(scores, keep, axis=1)
  draft, valid = None, None
  if sampled:  # the last level's frontier is never expanded: its q rows are not kept
    probs = jnp.concatenate(rows, axis=1)  # [B, 1 + (depth - 1) k, V]
    source = jnp.asarray(np.concatenate(cand_rows))[keep]
    draft = DraftDist(probs=probs, source=source.astype(jnp.int32),
                      without_replacement=children.mode == "wor",
                      counts_fixed=grown_counts_fixed(depth, k, num_nodes))
    valid = kept_scores > -jnp.inf
  # With one child per node the kept nodes are a prefix of the one path grown (scores only fall).
  tree = _make(jnp.take_along_axis(tokens, keep, axis=1), parent, depth_all[keep], None, valid,
               chain=k == 1 or num_nodes == 1, draft=draft)
  return DynamicTree(tree, kept_scores), carry


# ------------------------------------------------------------------------------------------------
# Trees from per-depth marginals (parallel drafters)


def tree_from_marginals(logp: jax.Array, *, num_nodes: int, top_k: int | None = None,
                        children: Children = TOP_K, sampling: SamplingConfig = GREEDY,
                        key: jax.Array | None = None) -> DynamicTree:
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

  With top-k children (the default) the tree needs no q (`Tree.draft` is None): recursive
  rejection against the target's own distribution keeps any temperature's output law exact.
  Sampled children (`children`, at a temperature > 0) are drawn from each depth's marginal at
  every expanded parent, the tree ranked by their slots' scores (`grow_dynamic_tree`).
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

  grown, _ = grow_dynamic_tree(logp[:, 0], expand, (), depth=d, top_k=k, num_nodes=num_nodes,
                               children=children, sampling=sampling, key=key)
  if grown.tree.draft is None:
    return grown
  # Every score is a slot's of a q that reads no token: the whole shape is fixed before any draw.
  return grown.replace(tree=grown.tree.replace(draft=grown.tree.draft.replace(counts_fixed=True)))
