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

import dataclasses
import functools
import warnings

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


RULES = ("recursive", "kseq", "typical")


@dataclasses.dataclass(frozen=True)
class Rule:
  """An acceptance rule (a static option: hashable). At temperature 0 every rule is greedy
  matching (`accept_greedy`), lossless.

  * "recursive" (the default): recursive rejection sampling, above. Lossless for any tree whose
    nodes were drawn from the q the tree carries (deterministic, i.i.d. or without replacement).
  * "kseq": SpecTr's k-sequential selection (Sun et al. 2023) at every node of a tree of i.i.d.
    children. A node with k children x_1..x_k ~ q i.i.d. tries them in order, accepting x_i
    with probability min(1, p(x_i) / (rho q(x_i))) against the node's own target p (no
    residual between siblings); if none is accepted the bonus is drawn from
      p_res = normalize(p - min(q, p / rho) (1 - (1 - beta)^k) / beta),  beta = sum min(q, p / rho).
    Proof sketch: trial i accepts and emits y with probability (1 - beta)^(i - 1) min(q, p /
    rho)(y), so the k trials emit y with min(q, p / rho)(y) (1 - (1 - beta)^k) / beta, and the
    bonus adds (1 - beta)^k p_res(y); the unnormalised p_res sums to 1 - (1 - (1 - beta)^k) =
    (1 - beta)^k, so the total is p(y), provided p_res >= 0, i.e. (1 - (1 - beta)^k) <= rho beta
    (min(q, p / rho) <= p / rho). rho = k always satisfies it (Bernoulli's inequality) and rho =
    1 does for k = 1 (the single-draft rule); the smallest such rho (`kseq_rho`) accepts most,
    since 1 - (1 - beta)^k falls with rho. Below an accepted child the induction repeats on its
    own children. Needs i.i.d. sampled children (the same q for every sibling, drawn
    independently) whose number does not depend on their tokens nor on anything drawn below
    them (`trees.DraftDist.counts_fixed`): otherwise rho, which depends on k, would depend on
    the very draft it tests. EAGLE-2's pruned tree violates that and is refused.
  * "typical": Medusa-2's typical acceptance (Cai et al. 2024): the first child x with p(x) >
    min(epsilon, alpha exp(-H(p))) is accepted, the bonus drawn from p where the walk stops.
    **Lossy**: a likely-enough draft is kept whatever the target's law, which over-represents
    the drafter's favourites (the tests measure the difference). Off by default; choosing it
    warns, and results record it.
  """

  name: str = "recursive"
  epsilon: float = 0.09  # typical: the hard threshold (Medusa's posterior_threshold)
  alpha: float = 0.3  # typical: the entropy-scaled threshold's factor (posterior_alpha)

  def __post_init__(self):
    if self.name not in RULES:
      raise ValueError(f"rule must be one of {list(RULES)} (typical is lossy), got "
                       f"{self.name!r}")
    for field in ("epsilon", "alpha"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"rule {field} must be a number in (0, 1], got {value!r}")

  @property
  def lossy(self) -> bool:
    """Whether the rule changes the output law (typical acceptance)."""
    return self.name == "typical"

  @property
  def needs_iid(self) -> bool:
    """Whether the rule needs i.i.d. sampled children (k-sequential selection)."""
    return self.name == "kseq"


RECURSIVE = Rule()


def rule_of(rule: Rule | str | None) -> Rule:
  """A `Rule` from a rule or its name (None: recursive rejection). Its caller warns of a lossy
  one where it decides the output (`warn_if_lossy`)."""
  if rule is None:
    return RECURSIVE
  if isinstance(rule, str):
    rule = Rule(rule)
  if not isinstance(rule, Rule):
    raise ValueError(f"rule must be one of {list(RULES)} or a specjax.verify.Rule, got {rule!r}")
  return rule


def warn_if_lossy(rule: Rule, stacklevel: int = 3) -> None:
  """`LossyRuleWarning` when `rule` is lossy."""
  if rule.lossy:
    warnings.warn(f"verification rule {rule.name!r} is LOSSY: sampled output no longer follows "
                  "the target's distribution", LossyRuleWarning, stacklevel=stacklevel)


class LossyRuleWarning(UserWarning):
  """A lossy acceptance rule (typical acceptance) was chosen."""


class RuleMismatch(ValueError):
  """A rule that cannot verify a drafter's trees (`check_children`): a caller sweeping rules and
  drafters (the lab's sampling table) skips the pair, naming why."""


def check_children(rule: Rule, children_mode: str, counts_fixed: bool = True) -> None:
  """RuleMismatch (a ValueError) when `rule` cannot verify children drafted as `children_mode`
  ("top_k", "iid", "wor"; the mode a drafter uses at a temperature > 0) in a tree that fixes
  each node's number of children before drawing them or not (`counts_fixed`,
  `trees.DraftDist.counts_fixed`)."""
  if rule.needs_iid and children_mode != "iid":
    raise RuleMismatch(f"rule {rule.name!r} needs i.i.d. sampled children (children='iid'); this "
                     f"drafter's children are {children_mode!r}: use rule='recursive', or "
                     "build the drafter with children='iid'")
  if rule.needs_iid and not counts_fixed:
    raise RuleMismatch(f"rule {rule.name!r} needs each node's number of children fixed before "
                     "they are drawn; this drafter prunes a grown tree (EAGLE-2's, or a "
                     "corrected DFlash block's, with top_k > 1 and total_tokens below the "
                     "tree's capacity), keeping a child or not by what its earlier siblings drew "
                     "below them, which makes k-sequential selection lossy: use "
                     "rule='recursive', or a tree that keeps every candidate")


def _check_rule(rule: Rule, tree: Tree) -> None:
  if rule.needs_iid and tree.num_nodes:  # a tree without nodes (autoregressive) has no children
    if tree.draft is None or tree.draft.without_replacement:
      check_children(rule, "top_k" if tree.draft is None else "wor")
    check_children(rule, "iid", tree.draft.counts_fixed)


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


def _row_q(draft, vocab_size: int):
  """(rows float32[P, Vq], ids int32[Vq] or None) of one batch row's `DraftDist` -> a function
  of a row index giving that row over the target's vocabulary, float32[V]."""
  rows, ids = draft

  def q_of(src):
    q = rows[src]
    if ids is None:
      return q
    return jnp.zeros((vocab_size,), jnp.float32).at[ids].add(q)  # 0 outside the draft's ids

  return q_of


def _walk_row(p, tokens, parent, valid, draft, uniforms, *, without_replacement: bool):
  """The scan over one row's nodes. p: [N+1, V]; tokens, parent, valid, uniforms: [N];
  draft: (rows [P, Vq], ids [Vq] or None, source [N]) or None (deterministic children).
  Returns (accepted bool[N], cur int32[], r [V])."""
  v = p.shape[-1]
  q_of = None if draft is None else _row_q(draft[:2], v)
  source = jnp.zeros_like(tokens) if draft is None else draft[2]

  def step(carry, node):
    cur, r, drawn = carry  # cur: block row of the deepest accepted node (0 = root)
    i, token, par, ok, src, u = node
    if q_of is None:  # a deterministic child is a draft with one-hot q
      q_i = jax.nn.one_hot(token, v, dtype=jnp.float32)
    else:
      q_i = q_of(src)
      if without_replacement:  # the row without the tokens of the siblings tried before
        q_i = jnp.where(drawn, 0.0, q_i)
        q_i = q_i / jnp.maximum(jnp.sum(q_i), jnp.finfo(jnp.float32).tiny)
    tried = ok & (par + 1 == cur)  # block row of the parent is parent + 1 (root: -1 + 1 = 0)
    hit, residual = try_node(r, token, q_i, u)
    accepted = tried & hit
    r = jnp.where(accepted, p[i + 1], jnp.where(tried, _renormalise(residual, p[cur]), r))
    if without_replacement:  # a move to a child starts its sibling list afresh
      drawn = jnp.where(accepted, False, drawn.at[token].set(drawn[token] | tried))
    return (jnp.where(accepted, i + 1, cur), r, drawn), accepted

  drawn = jnp.zeros((v if without_replacement else 0,), bool)
  nodes = (jnp.arange(tokens.shape[0], dtype=jnp.int32), tokens, parent, valid, source,
           uniforms)
  (cur, r, _), accepted = jax.lax.scan(step, (jnp.int32(0), p[0], drawn), nodes)
  return accepted, cur, r


def _draft_args(tree: Tree):
  """The tree's draft distributions as `_walk_row`'s per-row tuple (vmapped over rows)."""
  d = tree.draft
  if d is None:
    return None, (None, None)
  ids_axis = None if d.ids is None else 0
  return (d.probs.astype(jnp.float32), d.ids, d.source), (0, ids_axis)


def walk(tree: Tree, p: jax.Array, uniforms: jax.Array, rule: Rule | None = None):
  """The acceptance walk with injected uniforms (white-box entry point).

  p: float32[B, N+1, V] target distributions per block row; uniforms: float32[B, N], one per node
  (used only if the node is tried). Returns (accepted_node bool[B, N], cur int32[B] the block row
  of the last accepted node, residual float32[B, V] normalised: the bonus token's distribution).
  rule: the acceptance rule (`Rule`; default recursive rejection).
  """
  rule = RECURSIVE if rule is None else rule
  _check_rule(rule, tree)
  p = p.astype(jnp.float32)
  uniforms = uniforms.astype(jnp.float32)
  if rule.name == "kseq":
    return _kseq_walk(tree, p, uniforms)
  if rule.name == "typical":
    return _typical_walk(tree, p, rule)
  draft, (rows_axis, ids_axis) = _draft_args(tree)
  wor = tree.draft is not None and tree.draft.without_replacement
  if draft is None:
    def row(p, tokens, parent, valid, u):
      return _walk_row(p, tokens, parent, valid, None, u, without_replacement=False)
    return jax.vmap(row)(p, tree.tokens, tree.parent, tree.valid, uniforms)
  row = functools.partial(_walk_row, without_replacement=wor)
  return jax.vmap(row, in_axes=(0, 0, 0, 0, (rows_axis, ids_axis, 0), 0))(
      p, tree.tokens, tree.parent, tree.valid, draft, uniforms)


# ------------------------------------------------------------------------------------------------
# SpecTr's k-sequential selection


def _children_stats(tree: Tree, v: int):
  """Per block row j (0 the root, i + 1 node i): k[B, N+1] its valid children, and q[B, N+1, V]
  the row they were drawn from (zeros for a leaf)."""
  b, n = tree.tokens.shape
  rows = tree.draft.row_q(v)  # [B, P, V]
  par_row = jnp.where(tree.valid, tree.parent + 1, n + 1)  # an invalid node counts nowhere
  bidx = jnp.arange(b)[:, None]
  k = jnp.zeros((b, n + 2), jnp.int32).at[bidx, par_row].add(1)[:, :n + 1]
  src = jnp.zeros((b, n + 2), jnp.int32).at[bidx, par_row].max(tree.draft.source)[:, :n + 1]
  q = jnp.take_along_axis(rows, src[:, :, None], axis=1) * (k > 0)[:, :, None]
  return k, q


KSEQ_ITERS = 30  # bisection steps for rho: its bracket [1, k] shrinks to (k - 1) 2^-30


def kseq_rho(p: jax.Array, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(rho, beta) of k-sequential selection for target p and draft q ([..., V]) with k i.i.d.
  drafts: the smallest rho in [1, k] with 1 - (1 - beta)^k <= rho beta, beta = sum min(q, p /
  rho) (bisection, keeping the end that satisfies the bound; k <= 1 gives rho = 1)."""
  kf = jnp.maximum(k, 1).astype(jnp.float32)

  def beta(rho):
    return jnp.sum(jnp.minimum(q, p / rho[..., None]), axis=-1)

  def ok(rho):
    b = beta(rho)
    return 1.0 - (1.0 - b) ** kf <= rho * b

  def step(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    good = ok(mid)
    return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

  lo, hi = jnp.ones_like(kf), kf
  _, hi = jax.lax.fori_loop(0, KSEQ_ITERS, step, (lo, hi))
  rho = jnp.where(ok(lo), lo, hi)
  return rho, beta(rho)


def kseq_residual(p: jax.Array, q: jax.Array, k: jax.Array, rho: jax.Array, beta: jax.Array
                  ) -> jax.Array:
  """normalize(p - min(q, p / rho) (1 - (1 - beta)^k) / beta): the law of the bonus when all k
  drafts are rejected (p itself for k = 0)."""
  kf = k.astype(jnp.float32)[..., None]
  b = beta[..., None]
  scale = jnp.where(b > 0, (1.0 - (1.0 - b) ** kf) / jnp.maximum(b, EMPTY_MASS), kf)
  res = jnp.maximum(p - jnp.minimum(q, p / rho[..., None]) * scale, 0.0)
  res = jnp.where(kf > 0, res, p)
  mass = jnp.sum(res, axis=-1, keepdims=True)
  return jnp.where(mass > EMPTY_MASS, res / jnp.maximum(mass, EMPTY_MASS), p)


def _kseq_walk(tree: Tree, p: jax.Array, uniforms: jax.Array):
  """K-SEQ at every node of a tree of i.i.d. children (module docstring, `Rule`)."""
  v = p.shape[-1]
  k, q_child = _children_stats(tree, v)  # [B, N+1], [B, N+1, V]
  rho, beta = kseq_rho(p, q_child, k)  # [B, N+1]

  def row(p, q_child, rho, tokens, parent, valid, u):
    def step(cur, node):
      i, token, par, ok, u_i = node
      tried = ok & (par + 1 == cur)
      accepted = tried & (u_i * rho[cur] * q_child[cur, token] < p[cur, token])
      return jnp.where(accepted, i + 1, cur), accepted

    nodes = (jnp.arange(tokens.shape[0], dtype=jnp.int32), tokens, parent, valid, u)
    return jax.lax.scan(step, jnp.int32(0), nodes)

  cur, accepted = jax.vmap(row)(p, q_child, rho, tree.tokens, tree.parent, tree.valid, uniforms)
  at = cur[:, None]
  take = lambda x: jnp.take_along_axis(x, at, axis=1)[:, 0]  # noqa: E731
  residual = kseq_residual(
      jnp.take_along_axis(p, at[:, :, None], axis=1)[:, 0],
      jnp.take_along_axis(q_child, at[:, :, None], axis=1)[:, 0], take(k), take(rho),
      take(beta))
  return accepted, cur, residual


# ------------------------------------------------------------------------------------------------
# Typical acceptance (lossy)


def typical_threshold(p: jax.Array, rule: Rule) -> jax.Array:
  """min(epsilon, alpha exp(-H(p))) over [..., V]: the probability a child must exceed."""
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.minimum(rule.epsilon, rule.alpha * jnp.exp(-entropy))


def _typical_walk(tree: Tree, p: jax.Array, rule: Rule):
  """Typical acceptance: at each node the first child whose target probability exceeds the
  threshold is accepted; the bonus is drawn from p where the walk stops."""
  thresh = typical_threshold(p, rule)  # [B, N+1]

  def row(p, thresh, tokens, parent, valid):
    def step(cur, node):
      i, token, par, ok = node
      accepted = ok & (par + 1 == cur) & (p[cur, token] > thresh[cur])
      return jnp.where(accepted, i + 1, cur), accepted

    nodes = (jnp.arange(tokens.shape[0], dtype=jnp.int32), tokens, parent, valid)
    return jax.lax.scan(step, jnp.int32(0), nodes)

  cur, accepted = jax.vmap(row)(p, thresh, tree.tokens, tree.parent, tree.valid)
  return accepted, cur, jnp.take_along_axis(p, cur[:, None, None], axis=1)[:, 0]


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
                         *, greedy: bool = False, rule: Rule | None = None) -> Acceptance:
  """`accept` with the target distributions p: float32[B, N+1, V] and the accept uniforms
  float32[B, N] given; the bonus is drawn with row_keys(bonus_key, B) (or argmax when greedy)."""
  _check_shapes(tree, p)
  accepted, _, residual = walk(tree, p, uniforms, rule)
  bonus = draw_bonus(residual, row_keys(bonus_key, tree.batch_size), greedy)
  return _assemble(tree.tokens, accepted, bonus, chain=tree.chain)


@functools.partial(jax.jit, static_argnames="rule")
def accept(tree: Tree, logits: jax.Array, sampling: SamplingConfig, rng: jax.Array,
           rule: Rule | None = None) -> Acceptance:
  """Verifies `tree` against the target's logits: float[B, N+1, V] (row 0 at the root, row i + 1
  at node i) under `sampling` (temperature / top-k / top-p applied to the target, greedy = T 0;
  a pytree whose mode is static and whose temperature and top-p are traced) by `rule` (a static
  `Rule`; None: recursive rejection).

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
  return accept_with_uniforms(tree, p, uniforms, bonus_key, greedy=sampling.greedy, rule=rule)


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
  d = tree.draft
  if d is not None and d.ids is None and d.probs.shape[-1] != x.shape[-1]:
    raise ValueError(f"draft q has vocab {d.probs.shape[-1]}, the target has {x.shape[-1]}")
