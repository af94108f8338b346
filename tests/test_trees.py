"""`specjax.trees`: templates from Medusa-style paths, builders, derived masks and validation.

The masks decide what each tree node attends to during verification; a wrong mask silently feeds
the target a context that is not the node's own prefix, so they are checked against a brute-force
walk up the parent pointers on random trees, including invalid nodes and N = 0.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import trees
from specjax.trees import Tree, TreeTemplate

MEDUSA = [(0,), (1,), (0, 0), (0, 1), (1, 0)]


def _random_paths(rng, n, max_depth=4, max_children=3):
  """n distinct paths forming a tree: each new node hangs below a random existing node (or the
  root) with the next free rank, so every prefix exists."""
  paths, kids = [], {(): 0}
  for _ in range(n):
    options = [p for p in kids if len(p) < max_depth and kids[p] < max_children]
    par = options[rng.integers(len(options))]
    path = par + (kids[par],)
    kids[par] += 1
    kids[path] = 0
    paths.append(path)
  return paths


def _random_tree(rng, batch, n, vocab=7, p_invalid=0.25) -> Tree:
  """A batch of trees on one random template with random tokens; random nodes are invalidated
  together with all their descendants (validity closed under descent, as validate() requires)."""
  tpl = TreeTemplate.from_paths(_random_paths(rng, n))
  valid = rng.random((batch, n)) >= p_invalid
  for i in range(n):
    if tpl.parent[i] >= 0:
      valid[:, i] &= valid[:, tpl.parent[i]]
  return tpl.tree(rng.integers(0, vocab, (batch, n)), valid=valid)


def _brute_ancestors(parent, valid, i) -> set[int]:
  """Ancestor-or-self set of node i by walking parent pointers (invalid: only itself)."""
  if not valid[i]:
    return {i}
  out = {i}
  while parent[i] >= 0:
    i = parent[i]
    out.add(i)
  return out


# ------------------------------------------------------------------------------------------------
# TreeTemplate


def test_from_paths_sorts_topologically_and_derives_parent_depth_rank():
  """Paths given in any order come out sorted by (depth, path): parents first, siblings in rank
  order; parent/depth/rank follow from the sorted paths (the Medusa example worked by hand)."""
  shuffled = [(1, 0), (0, 1), (1,), (0, 0), (0,)]
  tpl = TreeTemplate.from_paths(shuffled)
  assert tpl.paths == tuple(MEDUSA)
  np.testing.assert_array_equal(tpl.parent, [-1, -1, 0, 0, 1])
  np.testing.assert_array_equal(tpl.depth, [1, 1, 2, 2, 2])
  np.testing.assert_array_equal(tpl.rank, [0, 1, 0, 1, 0])
  assert tpl.parent.dtype == np.int32 and tpl.num_nodes == 5 and tpl.max_depth == 2
  # Order-independent identity: hashable and equal, so usable as a static jit argument.
  assert tpl == TreeTemplate.from_paths(MEDUSA) and hash(tpl) == hash(TreeTemplate(MEDUSA))
  assert {tpl: 1}[TreeTemplate.from_paths(reversed(MEDUSA))] == 1


def test_from_paths_random_trees_are_consistent():
  """On random path sets, each node's parent is the node holding its path minus the last rank, and
  the parent precedes it."""
  rng = np.random.default_rng(0)
  for n in (1, 5, 17):
    paths = _random_paths(rng, n)
    rng.shuffle(paths)
    tpl = TreeTemplate.from_paths(paths)
    for i, path in enumerate(tpl.paths):
      assert tpl.depth[i] == len(path) and tpl.rank[i] == path[-1]
      if len(path) == 1:
        assert tpl.parent[i] == -1
      else:
        assert tpl.parent[i] < i and tpl.paths[tpl.parent[i]] == path[:-1]


@pytest.mark.parametrize("paths, message", [
    ([(0,), (0, 0, 0)], "prefix"),
    ([(1, 0)], "prefix"),
    ([(0,), (1,), (0,)], "duplicate"),
    ([(0,), (-1,)], "ranks"),
    ([(0,), ()], "root is implicit"),
    ([(0,), (0.5,)], "ranks"),
])
def test_from_paths_rejects_bad_paths(paths, message):
  """Missing prefixes, duplicates, negative or non-integer ranks, and the empty path are errors."""
  with pytest.raises(ValueError, match=message):
    TreeTemplate.from_paths(paths)


def test_chain_template():
  """chain(L): node d - 1 is the rank-0 child of node d - 2; chain(0) is the empty template."""
  tpl = TreeTemplate.chain(4)
  assert tpl.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
  np.testing.assert_array_equal(tpl.parent, [-1, 0, 1, 2])
  np.testing.assert_array_equal(tpl.depth, [1, 2, 3, 4])
  np.testing.assert_array_equal(tpl.rank, [0, 0, 0, 0])
  empty = TreeTemplate.chain(0)
  assert empty.num_nodes == 0 and empty.max_depth == 0 and empty.parent.shape == (0,)


def test_full_template_is_topk_expansion():
  """full((2, 3, 1)): 2 root children, 3 children under each, 1 below each of those: 2 + 6 + 6
  nodes; every node at depth d - 1 has exactly branching[d - 1] children with ranks 0..k-1."""
  branching = (2, 3, 1)
  tpl = TreeTemplate.full(branching)
  assert tpl.num_nodes == 2 + 6 + 6 and tpl.max_depth == 3
  expected = {p for d in range(1, 4) for p in itertools.product(*map(range, branching[:d]))}
  assert set(tpl.paths) == expected
  for i in range(tpl.num_nodes):
    kids = [j for j in range(tpl.num_nodes) if tpl.parent[j] == i]
    want = branching[tpl.depth[i]] if tpl.depth[i] < len(branching) else 0
    assert sorted(tpl.rank[kids].tolist()) == list(range(want)) and kids == sorted(kids)
  assert TreeTemplate.full(()).num_nodes == 0
  assert TreeTemplate.full((3,)) == TreeTemplate.from_paths([(0,), (1,), (2,)])
  with pytest.raises(ValueError, match="branching"):
    TreeTemplate.full((2, 0))


def test_template_tree_fills_tokens_and_broadcasts_structure():
  """template.tree(tokens[B, N]) gives int32 fields of shape [B, N], all-valid by default, and
  checks that tokens, q and valid have the template's node count."""
  tpl = TreeTemplate.from_paths(MEDUSA)
  tokens = np.arange(10).reshape(2, 5)
  q = np.full((2, 5, 11), 1 / 11, np.float32)
  tree = tpl.tree(tokens, q=q)
  np.testing.assert_array_equal(tree.tokens, tokens)
  np.testing.assert_array_equal(tree.parent, np.broadcast_to(tpl.parent, (2, 5)))
  np.testing.assert_array_equal(tree.depth, np.broadcast_to(tpl.depth, (2, 5)))
  assert tree.valid.dtype == bool and bool(jnp.all(tree.valid))
  assert tree.tokens.dtype == jnp.int32 and tree.draft.probs.dtype == jnp.float32
  np.testing.assert_array_equal(tree.node_q(11), q)
  with pytest.raises(ValueError, match="5"):
    tpl.tree(tokens[:, :4])
  with pytest.raises(ValueError, match="q has shape"):
    tpl.tree(tokens, q=q[:, :4])
  with pytest.raises(ValueError, match="valid has shape"):
    tpl.tree(tokens, valid=np.ones((2, 4), bool))


def test_chain_builder():
  """trees.chain(tokens[B, G]): parent i - 1, depth i + 1; it equals the chain template's tree."""
  tokens = np.array([[3, 1, 4], [1, 5, 9]])
  tree = trees.chain(tokens)
  np.testing.assert_array_equal(tree.parent, [[-1, 0, 1]] * 2)
  np.testing.assert_array_equal(tree.depth, [[1, 2, 3]] * 2)
  ref = TreeTemplate.chain(3).tree(tokens)
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)
  assert tree.draft is None


def test_chain_flag_marks_exactly_the_static_chains():
  """`Tree.chain` (static) is set on every builder's chains and on nothing that branches: a tree
  marked a chain is committed without moving its nodes' KV rows, so a wrong mark would keep the
  wrong rows."""
  tokens = np.zeros((2, 4), int)
  assert trees.chain(tokens).chain and Tree.empty(2).chain
  assert TreeTemplate.chain(4).tree(tokens).chain
  assert not TreeTemplate.from_paths(MEDUSA).tree(np.zeros((2, 5), int)).chain
  logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (2, 4, 16)))
  for top_k, num_nodes, want in ((1, 4, True), (3, 1, True), (3, 6, False)):
    tree = trees.tree_from_marginals(logp, num_nodes=num_nodes, top_k=top_k).tree
    assert tree.chain == want
    if want:
      np.testing.assert_array_equal(tree.parent, [list(range(-1, num_nodes - 1))] * 2)
  assert trees.is_chain(np.array([-1, 0, 1])) and not trees.is_chain(np.array([-1, 0, 0]))
  # Static: it survives jit, and validate accepts the marked chains.
  assert jax.jit(lambda t: t)(trees.chain(tokens)).chain
  trees.validate(trees.chain(tokens))


def test_tree_is_a_pytree_with_optional_q():
  """Tree passes through jit with and without q (None is an empty subtree), keeping its fields."""
  tpl = TreeTemplate.from_paths(MEDUSA)
  with_q = tpl.tree(np.zeros((2, 5), int), q=np.full((2, 5, 3), 1 / 3))
  for tree in (tpl.tree(np.zeros((2, 5), int)), with_q):
    out = jax.jit(lambda t: t.replace(tokens=t.tokens + 1))(tree)
    np.testing.assert_array_equal(out.tokens, 1)
    assert (out.draft is None) == (tree.draft is None)
  assert len(jax.tree.leaves(with_q)) == 6  # + the draft rows and their sources


# ------------------------------------------------------------------------------------------------
# Masks


def test_masks_on_medusa_example():
  """The Medusa example written out by hand: node (0, 1) = index 3 sees root, node 0, itself."""
  tree = TreeTemplate.from_paths(MEDUSA).tree(np.zeros((1, 5), int))
  anc = np.array([[1, 0, 0, 0, 0],
                  [0, 1, 0, 0, 0],
                  [1, 0, 1, 0, 0],
                  [1, 0, 0, 1, 0],
                  [0, 1, 0, 0, 1]], bool)
  np.testing.assert_array_equal(trees.ancestor_mask(tree)[0], anc)
  block = np.zeros((6, 6), bool)
  block[:, 0] = True
  block[1:, 1:] = anc
  np.testing.assert_array_equal(trees.verify_mask(tree)[0], block)
  np.testing.assert_array_equal(trees.positions_offsets(tree), [[0, 1, 1, 2, 2, 2]])


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
def test_masks_match_brute_force_walk(n):
  """ancestor_mask == the parent-pointer walk; verify_mask = root column (valid nodes) + root row
  (itself only) + ancestor mask; positions = [0, depth]. Random trees of depth up to 4 with
  invalid subtrees; sizes around powers of two exercise the number of squarings."""
  rng = np.random.default_rng(n)
  tree = _random_tree(rng, batch=4, n=n)
  anc, vm = np.asarray(trees.ancestor_mask(tree)), np.asarray(trees.verify_mask(tree))
  parent, valid = np.asarray(tree.parent), np.asarray(tree.valid)
  assert anc.shape == (4, n, n) and vm.shape == (4, n + 1, n + 1)
  for b in range(4):
    for i in range(n):
      want = _brute_ancestors(parent[b], valid[b], i)
      assert set(np.nonzero(anc[b, i])[0]) == want, (b, i)
      assert set(np.nonzero(vm[b, i + 1])[0]) == ({0} | {j + 1 for j in want}
                                                   if valid[b, i] else {i + 1})
    assert set(np.nonzero(vm[b, 0])[0]) == {0}
  np.testing.assert_array_equal(trees.positions_offsets(tree),
                                np.concatenate([np.zeros((4, 1)), tree.depth], 1))


def test_deep_chain_mask_is_lower_triangular():
  """A chain of 40 needs every squaring step: its ancestor mask is the full lower triangle."""
  tree = trees.chain(np.zeros((2, 40), int))
  np.testing.assert_array_equal(trees.ancestor_mask(tree), np.tril(np.ones((2, 40, 40), bool)))


@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_chain_closed_form_equals_the_closure(n):
  """A chain's ancestor mask (closed form, `Tree.chain`) equals the general squaring closure of
  the same parents, with invalid nodes anywhere along it (after an invalid node, the nodes below
  it reach only as far up as that node)."""
  rng = np.random.default_rng(n)
  tokens = rng.integers(0, 5, (64, n))
  valid = rng.random((64, n)) < 0.8
  tree = trees.chain(tokens, valid=valid)
  general = Tree(tree.tokens, tree.parent, tree.depth, tree.valid)  # same tree, chain=False
  assert tree.chain and not general.chain
  np.testing.assert_array_equal(trees.ancestor_mask(tree), trees.ancestor_mask(general))
  np.testing.assert_array_equal(trees.verify_mask(tree), trees.verify_mask(general))


def test_empty_tree():
  """N = 0 (autoregressive decoding): shapes [B, 0], the root sees itself, positions [0]."""
  tree = Tree.empty(3)
  assert tree.tokens.shape == (3, 0) and tree.num_nodes == 0 and tree.draft is None
  assert trees.ancestor_mask(tree).shape == (3, 0, 0)
  np.testing.assert_array_equal(trees.verify_mask(tree), np.ones((3, 1, 1), bool))
  np.testing.assert_array_equal(trees.positions_offsets(tree), np.zeros((3, 1)))
  trees.validate(tree, vocab_size=5)
  assert trees.chain(np.zeros((2, 0), int)).num_nodes == 0


# ------------------------------------------------------------------------------------------------
# validate


def _good_tree():
  tokens = np.array([[1, 2, 3, 4, 0]])
  q = np.full((1, 5, 5), 0.2, np.float32)
  return TreeTemplate.from_paths(MEDUSA).tree(tokens, q=q, valid=[[1, 0, 1, 1, 0]])


def _with_probs(tree, probs):
  return tree.replace(draft=tree.draft.replace(probs=probs))


def test_validate_accepts_good_trees():
  """Well-formed trees pass: the Medusa tree with q and a pruned subtree, and random trees."""
  trees.validate(_good_tree())
  trees.validate(_random_tree(np.random.default_rng(1), 3, 20), vocab_size=7)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace(parent=t.parent.at[0, 1].set(2)), "does not precede"),
    (lambda t: t.replace(parent=t.parent.at[0, 2].set(-2)), "does not precede"),
    (lambda t: t.replace(depth=t.depth.at[0, 3].set(3)), "depth"),
    (lambda t: t.replace(depth=t.depth.at[0, 0].set(0)), "depth"),
    (lambda t: t.replace(valid=t.valid.at[0, 4].set(True)), "invalid"),
    (lambda t: t.replace(tokens=t.tokens.at[0, 2].set(5)), "outside"),
    (lambda t: t.replace(tokens=t.tokens.at[0, 1].set(-1)), "outside"),
    (lambda t: _with_probs(t, t.draft.probs.at[0, 0].set(jnp.eye(5)[0])), "q = 0"),  # token 1
    (lambda t: _with_probs(t, t.draft.probs.at[0, 0].set(0.3)), "sums to"),
    (lambda t: _with_probs(t, t.draft.probs.at[0, 0, 0].set(jnp.nan)), "non-finite"),
    (lambda t: _with_probs(t, t.draft.probs[:, :, None]), "probs has shape"),
    (lambda t: t.replace(draft=t.draft.replace(source=t.draft.source.at[0, 0].set(7))),
     "outside"),
    (lambda t: t.replace(draft=t.draft.replace(ids=jnp.full((1, 5), -1, jnp.int32))), "outside"),
    (lambda t: t.replace(valid=t.valid[:, :4]), "valid has shape"),
    (lambda t: t.replace(chain=True), "marked chain"),
])
def test_validate_names_the_problem(edit, message):
  """Each malformation raises ValueError with a message naming it (node 4 is the child of the
  invalid node 1; ids must be in [0, 5))."""
  with pytest.raises(ValueError, match=message):
    trees.validate(edit(_good_tree()))


def test_validate_uses_explicit_vocab_without_q():
  """Without q the vocabulary is unknown unless given; with vocab_size the ids are checked."""
  tree = trees.chain(np.array([[0, 9]]))
  trees.validate(tree)
  with pytest.raises(ValueError, match=r"token id 9 outside \[0, 9\)"):
    trees.validate(tree, vocab_size=9)
