"""`specjax.verify`: the lossless acceptance rules, tested white-box and by their exact laws.

Layers of evidence, from white-box to black-box:
  1. the one-node step with injected uniforms (accept iff u q(x) < p(x), residual max(p - q, 0))
     and its edge cases (p = q, p(x) = 0, q(x) = 0, one-hot q, a numerically empty residual);
  2. greedy == a brute-force walk taking the child equal to the target argmax, for every rule;
  3. EXACT ENUMERATION: an independent float64 numpy re-derivation of the published rules,
     written as a structural tree walk (`ref_trials`): recursive rejection (Leviathan/Chen;
     SpecInfer), with siblings drawn without replacement from a shared row (Jeon et al.: the
     reference removes the earlier siblings' tokens and renormalises), over a reduced draft
     vocabulary; SpecTr's K-SEQ at every node of i.i.d. children (rho by float64 root finding);
     Medusa's typical acceptance. It gives the exact law of the first 2 and 3 emitted tokens
     (bonus included, over as many rounds as it takes, every ordered draw of the siblings
     enumerated with its probability) for sampled chains, sampled trees and deterministic trees;
     for the lossless rules it must equal the target's own autoregressive law p(x1) p(x2|x1)
     p(x3|x1,x2) to 1e-6, and typical acceptance must miss it (its `lossy` flag is honest). The
     target depends on position and on the previous token, so a node reading the wrong row of p
     is visible. verify.py's decisions are then checked against that reference step by step with
     injected uniforms, for every rule and for trees carrying `DraftDist` rows; `kseq_rho` is
     checked against its definition and its acceptance against one draft's and recursive
     rejection's; K-SEQ on a tree pruned by its own draws is shown lossy and refused;
  4. Monte Carlo of the jitted `accept` with real randomness: Pearson chi-square against the exact
     laws (cells with expected count < 5 pooled), each test at ALPHA = 1e-6; with the 14 such tests
     in this file the family-wise false-alarm probability is <= 1.4e-5 (Bonferroni). With 20000
     rows and <= 30 cells a bias of D = sum (r - p)^2 / p = 0.01 is detected with power > 0.9999;
  5. the `Acceptance` fields agree with each other; the empty tree samples from p[0].
"""

from __future__ import annotations

import collections
import functools
import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from specjax import trees, verify
from specjax.children import Children
from specjax.drafters.dflash import DFlashDrafter
from specjax.drafters.eagle_common import EagleDrafter
from specjax.sampling import SamplingConfig, target_probs
from specjax.trees import Tree, TreeTemplate

V = 5  # small enough to enumerate V^3 outcomes and V^4 sampled drafts
ALPHA = 1e-6
MC_ROWS = 20000
TOP2_CHAINS = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]  # top-2 at depth 1, chains below
TOP2 = [(0,), (1,), (0, 0), (1, 0)]

accept_u = jax.jit(verify.accept_with_uniforms, static_argnames=("greedy", "rule"))
walk = jax.jit(verify.walk, static_argnames="rule")


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _one_hot(x, v=V):
  return np.eye(v)[x]


# ================================================================================================
# The numpy reference: the published rule, float64, a structural walk (no index-order scan).


def ref_accept_prob(r, q, x):
  """min(1, r(x) / q(x)) for r normalised (Leviathan et al. 2023, Chen et al. 2023); q(x) = 0
  means the ratio is infinite (or 0 / 0 = no mass: reject)."""
  r = r / r.sum()
  if q[x] == 0:
    return 1.0 if r[x] > 0 else 0.0
  return min(1.0, r[x] / q[x])


def ref_residual(r, q, fallback):
  """normalize(max(r - q, 0)) (SpecInfer's residual); `fallback` if empty (documented in
  verify.EMPTY_MASS; only reachable in float-degenerate cases)."""
  res = np.maximum(r / r.sum() - q, 0.0)
  return res / res.sum() if res.sum() > verify.EMPTY_MASS else fallback / fallback.sum()


def ref_children(parent, valid, node):
  """Valid children of `node` (-1 = the root) in sibling order."""
  return [c for c in range(len(parent)) if valid[c] and parent[c] == node]


def _sibling_q(tokens, q, kids, j, wor=False):
  """The distribution child kids[j] was drawn from: one-hot at its token for a deterministic
  child (q None), else its row q[c]; drawn without replacement (`wor`), that row with the tokens
  of its earlier siblings kids[:j] removed and renormalised (Jeon et al. 2024)."""
  c = kids[j]
  if q is None:
    return _one_hot(tokens[c])
  qc = np.array(q[c], np.float64)
  if wor:
    qc[[int(tokens[s]) for s in kids[:j]]] = 0.0
    qc = qc / qc.sum()
  return qc


@functools.cache
def _kseq_rho_cached(p: bytes, q: bytes, k: int) -> float:
  return _ref_kseq_rho(np.frombuffer(p), np.frombuffer(q), k)


def ref_kseq_rho(p, q, k):
  """`_ref_kseq_rho`, cached: the enumerations meet the same few (p, q, k) many times."""
  return _kseq_rho_cached(np.asarray(p, np.float64).tobytes(), np.asarray(q, np.float64).tobytes(),
                          int(k))


def _ref_kseq_rho(p, q, k):
  """SpecTr's rho for k i.i.d. drafts (Sun et al. 2023): 1 when 1 - (1 - beta)^k <= beta at rho
  = 1 (k = 1 always), else the root in (1, k] of rho beta(rho) = 1 - (1 - beta(rho))^k, beta(rho)
  = sum min(q, p / rho) (float64 Brent; rho beta rises and 1 - (1 - beta)^k falls with rho)."""

  def gap(rho):
    beta = np.minimum(q, p / rho).sum()
    return rho * beta - (1.0 - (1.0 - beta) ** k)

  if gap(1.0) >= 0:
    return 1.0
  if gap(float(k)) <= 0:  # only by rounding: k satisfies the bound (Bernoulli's inequality)
    return float(k)
  return scipy.optimize.brentq(gap, 1.0, float(k), xtol=1e-15, rtol=4 * np.finfo(float).eps)


def ref_typical_threshold(p, rule):
  """Medusa's typical-acceptance threshold min(epsilon, alpha exp(-H(p))) (Cai et al. 2024)."""
  nz = p[p > 0]
  return min(rule.epsilon, rule.alpha * np.exp(np.sum(nz * np.log(nz))))


def ref_trials(rule, tokens, kids, q, pn, wor=False):
  """The trials at a node whose target is pn (normalised) and whose valid children are `kids`:
  ([the probability child kids[j] is accepted once kids[:j] were rejected], the bonus
  distribution when all are rejected), by `rule` (a `verify.Rule`, read for its name and
  thresholds only):

  recursive: min(1, r(x) / q_j(x)) against the residual r, r <- normalize(max(r - q_j, 0)) after
    each rejection (SpecInfer; q_j one-hot for a deterministic child; without replacement the
    row without the earlier siblings' tokens, renormalised);
  kseq: min(1, pn(x) / (rho q(x))) against pn itself for k i.i.d. children of one shared row q,
    the bonus normalize(pn - min(q, pn / rho) (1 - (1 - beta)^k) / beta) (SpecTr's K-SEQ);
  typical: 1 if pn(x) > the threshold else 0, the bonus pn (Medusa's typical acceptance)."""
  if rule.name == "typical":
    t = ref_typical_threshold(pn, rule)
    return [1.0 if pn[tokens[c]] > t else 0.0 for c in kids], pn
  if rule.name == "kseq":
    if not kids:
      return [], pn
    qn = np.asarray(q[kids[0]], np.float64)
    assert all(np.array_equal(q[c], q[kids[0]]) for c in kids), "K-SEQ needs one shared row"
    k = len(kids)
    rho = ref_kseq_rho(pn, qn, k)
    acc = [(1.0 if pn[tokens[c]] > 0 else 0.0) if qn[tokens[c]] == 0 else
           min(1.0, pn[tokens[c]] / (rho * qn[tokens[c]])) for c in kids]
    m = np.minimum(qn, pn / rho)
    beta = m.sum()
    res = pn - m * (1.0 - (1.0 - beta) ** k) / beta if beta > 0 else pn
    assert res.min() > -1e-12, res  # rho's bound keeps the bonus law a distribution
    res = np.maximum(res, 0.0)
    return acc, res / res.sum() if res.sum() > verify.EMPTY_MASS else pn
  r, acc = pn, []
  for j, c in enumerate(kids):
    qc = _sibling_q(tokens, q, kids, j, wor)
    acc.append(ref_accept_prob(r, qc, tokens[c]))
    r = ref_residual(r, qc, pn)
  return acc, r


def ref_round_law(tokens, parent, valid, q, p, rule=verify.RECURSIVE, wor=False):
  """Exact law of one round's emitted tokens (accepted drafts + bonus), as {tuple: prob}.

  p[0] is the target at the root, p[c + 1] at node c; q[c] the distribution node c was drawn
  from (None: deterministic children), or its parent's row when the siblings were drawn without
  replacement (`wor`: the reference removes the earlier siblings' tokens itself). Each tried
  child is accepted with its explicit probability (`ref_trials`, by `rule`), so the law is a
  finite sum over the branches of the decision tree.
  """
  law = collections.defaultdict(float)

  def visit(node, emitted, prob):
    pn = p[node + 1] / p[node + 1].sum()
    kids = ref_children(parent, valid, node)
    acc, res = ref_trials(rule, tokens, kids, q, pn, wor)
    for c, a in zip(kids, acc):
      if a > 0:
        visit(c, emitted + (int(tokens[c]),), prob * a)
      prob *= 1.0 - a
      if prob <= 0:
        return
    for y in np.nonzero(res)[0]:
      law[emitted + (int(y),)] += prob * res[y]

  visit(-1, (), 1.0)
  return law


def ref_walk(tokens, parent, valid, q, p, u, rule=verify.RECURSIVE, wor=False):
  """The same rule with given uniforms: accept iff u < accept probability. Returns (accepted
  nodes in order, the bonus distribution, the smallest |u - accept probability| seen)."""
  node, accepted, margin = -1, [], np.inf
  while True:
    pn = p[node + 1] / p[node + 1].sum()
    kids = ref_children(parent, valid, node)
    acc, res = ref_trials(rule, tokens, kids, q, pn, wor)
    for c, a in zip(kids, acc):
      margin = min(margin, abs(u[c] - a))
      if u[c] < a:
        node = c
        accepted.append(c)
        break
    else:
      return accepted, res, margin


# ------------------------------------------------------------------------------------------------
# A position- and prefix-dependent target and drafters over contexts (c, last): c = index of the
# next token to generate, last = the previous token (the root of the round's tree).


def _target_rows(table, c, tpl_depth, tokens, last):
  """Block rows of a table indexed [position, previous token]: row 0 = table[c, last], row i + 1 =
  table[c + depth_i, token_i]."""
  return np.concatenate([table[c, last][None], table[c + tpl_depth, tokens]], axis=0)


class SampledDrafter:
  """Node i's token is drawn from Q[c + depth_i - 1, parent token]: a q that depends on position
  and prefix. Siblings are i.i.d. (SpecInfer) or drawn without replacement (q_i renormalised over
  the tokens not taken by earlier siblings)."""

  def __init__(self, tpl: TreeTemplate, Q, without_replacement=False):
    self.tpl, self.Q, self.wor = tpl, np.asarray(Q), without_replacement

  def node_q(self, c, last, tokens, i):
    par = self.tpl.parent[i]
    q = self.Q[c + self.tpl.depth[i] - 1, last if par < 0 else tokens[..., par]].astype(np.float64)
    if self.wor:
      for s in range(i):
        if self.tpl.parent[s] == par:
          q = q * (1 - _one_hot(tokens[..., s], q.shape[-1]))
      q = q / q.sum(-1, keepdims=True)
    return q

  def enumerate(self, c, last):
    """[(weight, tokens, q, valid)]: every draft outcome with its probability (zeros pruned)."""
    n, out = self.tpl.num_nodes, []

    def grow(tokens, qs, w):
      if len(tokens) == n:
        out.append((w, np.array(tokens), np.stack(qs), np.ones(n, bool)))
        return
      q = self.node_q(c, last, np.array(tokens + [0] * (n - len(tokens))), len(tokens))
      for x in np.nonzero(q)[0]:
        grow(tokens + [int(x)], qs + [q], w * q[x])

    grow([], [], 1.0)
    return out

  def sample(self, rng, c, last):
    """Vectorised draws for rows with contexts c[B], last[B]: (tokens[B, N], q[B, N, V], valid)."""
    b, n = len(c), self.tpl.num_nodes
    tokens, qs = np.zeros((b, n), np.int64), np.zeros((b, n, self.Q.shape[-1]), np.float32)
    for i in range(n):
      q = self.node_q(c, last, tokens, i) if self.wor else self.Q[
          c + self.tpl.depth[i] - 1,
          last if self.tpl.parent[i] < 0 else tokens[:, self.tpl.parent[i]]]
      qs[:, i] = q
      cdf = np.cumsum(np.asarray(q, np.float64), -1)
      tokens[:, i] = np.argmax(rng.random((b, 1)) * cdf[:, -1:] < cdf, axis=-1)
    return tokens, qs, np.ones((b, n), bool)


class TopKDrafter:
  """Deterministic children: node i is the rank_i-th best token of D[c + depth_i - 1, parent
  token] (a top-k expansion, like Medusa heads); q = None."""

  def __init__(self, tpl: TreeTemplate, D):
    self.tpl, self.ranked = tpl, np.argsort(-np.asarray(D), axis=-1, kind="stable")

  def sample(self, rng, c, last):
    c, last = np.atleast_1d(c), np.atleast_1d(last)
    tokens = np.zeros((len(c), self.tpl.num_nodes), np.int64)
    for i in range(self.tpl.num_nodes):
      par = self.tpl.parent[i]
      prev = last if par < 0 else tokens[:, par]
      tokens[:, i] = self.ranked[c + self.tpl.depth[i] - 1, prev, self.tpl.rank[i]]
    return tokens, None, np.ones(tokens.shape, bool)

  def enumerate(self, c, last):
    tokens, _, valid = self.sample(None, c, last)
    return [(1.0, tokens[0], None, valid[0])]


class TableDrafter:
  """Deterministic children from an arbitrary table indexed by the context: any tokens (duplicate
  siblings included) and any validity closed under descent. Exact for any choice that does not
  look at the target's random draws."""

  def __init__(self, tpl: TreeTemplate, tokens, valid):
    self.tpl, self.tokens, self.valid = tpl, tokens, valid  # [POS, V, N]

  def sample(self, rng, c, last):
    return self.tokens[c, last], None, self.valid[c, last]

  def enumerate(self, c, last):
    return [(1.0, self.tokens[c, last], None, self.valid[c, last])]


class RowDrafter:
  """Sampled children as `trees.DraftDist` carries them: the children of a node share one row,
  the children of the node with token t at depth d (the root: t = last, d = 0) drawn from
  Q[c + d, t], i.i.d. or without replacement (`without_replacement`: each sibling from the row
  without its earlier siblings' tokens, renormalised). Q's rows are over a draft vocabulary
  `ids` (target ids; default all V), so the other target ids have q = 0."""

  def __init__(self, tpl: TreeTemplate, Q, without_replacement=False, ids=None):
    self.tpl, self.Q, self.without_replacement = tpl, np.asarray(Q), without_replacement
    self.ids = None if ids is None else np.asarray(ids)
    self.parents = [-1] + sorted({int(x) for x in tpl.parent if x >= 0})  # one row each
    self.source = np.array([self.parents.index(int(x)) for x in tpl.parent], np.int32)

  def _rows(self, c, last, tokens):
    """float64 rows [..., P, Vq] below each parent, for contexts c, last and tokens [..., N]."""
    rows = []
    for par in self.parents:
      d = 0 if par < 0 else self.tpl.depth[par]
      rows.append(self.Q[c + d, last if par < 0 else tokens[..., par]])
    return np.stack(rows, -2).astype(np.float64)

  def full(self, rows):
    """Rows over the draft ids [..., Vq] -> over the target's vocabulary [..., V]."""
    if self.ids is None:
      return rows
    out = np.zeros(rows.shape[:-1] + (V,))
    out[..., self.ids] = rows
    return out

  def node_rows(self, draft: trees.DraftDist):
    """float64[B, N, V]: the row each node was drawn from, over target ids (the reference's q)."""
    rows = self.full(np.asarray(draft.probs, np.float64))
    return rows[:, self.source]

  def enumerate(self, c, last):
    """[(weight, tokens, rows [N, V], valid)]: every draw with its probability (zeros pruned)."""
    n, tpl, out = self.tpl.num_nodes, self.tpl, []

    def walk(tokens, w):
      toks = np.array(tokens + [0] * (n - len(tokens)))
      rows = self.full(self._rows(c, last, toks))  # final for every parent drawn so far
      i = len(tokens)
      if i == n:
        out.append((w, toks, rows[self.source], np.ones(n, bool)))
        return
      q = rows[self.source[i]].copy()
      if self.without_replacement:
        q[[tokens[s] for s in range(i) if tpl.parent[s] == tpl.parent[i]]] = 0.0
        q = q / q.sum()
      for x in np.nonzero(q)[0]:
        walk(tokens + [int(x)], w * q[x])

    walk([], 1.0)
    return out

  def sample(self, rng, c, last):
    """Vectorised draws at contexts c[B], last[B]: (tokens[B, N], DraftDist, valid[B, N])."""
    b, n = len(c), self.tpl.num_nodes
    tokens, idx = np.zeros((b, n), np.int64), np.zeros((b, n), np.int64)  # target, draft ids
    ids = np.arange(self.Q.shape[-1]) if self.ids is None else self.ids
    for i in range(n):
      rows = self._rows(c, last, tokens).astype(np.float32)  # final for every parent drawn
      q = rows[:, self.source[i]].astype(np.float64)
      if self.without_replacement:
        for s in range(i):
          if self.tpl.parent[s] == self.tpl.parent[i]:
            q[np.arange(b), idx[:, s]] = 0.0
      cdf = np.cumsum(q, -1)
      idx[:, i] = np.argmax(rng.random((b, 1)) * cdf[:, -1:] < cdf, axis=-1)
      tokens[:, i] = ids[idx[:, i]]
    rows = self._rows(c, last, tokens).astype(np.float32)
    draft = trees.DraftDist(
        probs=jnp.asarray(rows), source=jnp.broadcast_to(jnp.asarray(self.source), (b, n)),
        ids=None if self.ids is None else jnp.broadcast_to(jnp.asarray(ids, jnp.int32),
                                                            (b, len(ids))),
        without_replacement=self.without_replacement)
    return tokens, draft, np.ones((b, n), bool)


def exact_round_law(drafter, P, c, last, rule=verify.RECURSIVE):
  """Exact one-round law at context (c, last): the reference law averaged over draft outcomes."""
  law = collections.defaultdict(float)
  tpl, wor = drafter.tpl, getattr(drafter, "without_replacement", False)
  for w, tokens, q, valid in drafter.enumerate(c, last):
    p = _target_rows(P, c, tpl.depth, tokens, last)
    for seq, pr in ref_round_law(tokens, tpl.parent, valid, q, p, rule, wor).items():
      law[seq] += w * pr
  return law


def exact_first_k_law(drafter, P, k, last0, rule=verify.RECURSIVE):
  """Exact law of the first k emitted tokens of speculative decoding from context (0, last0),
  chaining rounds until k tokens exist."""
  law = collections.defaultdict(float)
  round_law = functools.cache(lambda c, last: exact_round_law(drafter, P, c, last, rule))

  def go(prefix, prob):
    for seq, pr in round_law(len(prefix), prefix[-1] if prefix else last0).items():
      new = prefix + seq
      if len(new) >= k:
        law[new[:k]] += prob * pr
      else:
        go(new, prob * pr)

  go((), 1.0)
  return law


def target_law(P, k, last0):
  """The target's own autoregressive law p(x1) p(x2 | x1) ... as an array [V] * k."""
  out = np.ones((V,) * k)
  for xs in itertools.product(range(V), repeat=k):
    prev = last0
    for c, x in enumerate(xs):
      out[xs] *= P[c, prev, x]
      prev = x
  return out


def _law_array(law, k):
  out = np.zeros((V,) * k)
  for seq, pr in law.items():
    out[seq] += pr
  return out


# ------------------------------------------------------------------------------------------------
# Problems: target tables and drafters


POS = 8  # positions c + depth stay below this (k <= 3, depth <= 4)


def _dense_target(rng):
  return _softmax(1.5 * rng.normal(size=(POS, V, V)))


def _sparse_target(rng):
  """Like _dense_target but about 40% of each row's tokens have p = 0 (as after top-k/top-p)."""
  logits = 1.5 * rng.normal(size=(POS, V, V))
  zero = rng.random((POS, V, V)) < 0.4
  zero[..., 0] &= ~np.all(zero, axis=-1)  # keep at least one token
  return _softmax(np.where(zero, -np.inf, logits))


def _random_table_drafter(rng, n=7, with_duplicates=False):
  """A random template of n nodes, random tokens per context, random invalid subtrees."""
  paths, kids = [], {(): 0}
  for _ in range(n):
    options = [p for p in kids if len(p) < 4]
    par = options[rng.integers(len(options))]
    paths.append(par + (kids[par],))
    kids[par] += 1
    kids[paths[-1]] = 0
  tpl = TreeTemplate.from_paths(paths)
  tokens = rng.integers(0, V, (POS, V, n))
  if with_duplicates:  # every sibling repeats its previous sibling's token
    for i in range(n):
      sib = [s for s in range(i) if tpl.parent[s] == tpl.parent[i]]
      if sib:
        tokens[..., i] = tokens[..., sib[-1]]
  valid = rng.random((POS, V, n)) > 0.2
  for i in range(n):
    if tpl.parent[i] >= 0:
      valid[..., i] &= valid[..., tpl.parent[i]]
  return TableDrafter(tpl, tokens, valid)


def make_problem(name, seed=0):
  """(target table P[pos, prev, :], drafter) for a named scenario."""
  rng = np.random.default_rng(seed)
  dense, sparse = _dense_target(rng), _sparse_target(rng)
  chain2, chain3 = TreeTemplate.chain(2), TreeTemplate.chain(3)
  noise = rng.normal(size=(POS, V, V))
  if name == "chain3_random_q":
    return dense, SampledDrafter(chain3, _softmax(rng.normal(size=(POS, V, V))))
  if name == "chain2_q_close_to_p":
    return dense, SampledDrafter(chain2, _softmax(np.log(dense) + 0.3 * noise))
  if name == "chain3_q_equals_p":
    return sparse, SampledDrafter(chain3, sparse)
  if name == "chain2_one_hot_q":  # an argmax drafter: q one-hot at its choice
    return dense, SampledDrafter(chain2, _one_hot(np.argmax(noise, -1)))
  if name == "chain2_adversarial_q":  # q's mass sits mostly where p = 0
    return sparse, SampledDrafter(chain2, _softmax(np.where(sparse == 0, 3.0, -1.0) + noise))
  if name == "tree_iid_siblings":
    return sparse, SampledDrafter(TreeTemplate.from_paths(TOP2), _softmax(noise))
  if name == "tree_without_replacement":
    return dense, SampledDrafter(TreeTemplate.from_paths(TOP2), _softmax(noise), True)
  if name == "top2_then_chains":
    return dense, TopKDrafter(TreeTemplate.from_paths(TOP2_CHAINS), noise)
  if name == "top3_sparse_target":
    return sparse, TopKDrafter(TreeTemplate.full((3, 1)), noise)
  if name == "duplicate_siblings":
    return dense, _random_table_drafter(rng, 7, with_duplicates=True)
  if name == "random_template":
    return sparse, _random_table_drafter(rng, 8)
  two_levels, three = TreeTemplate.from_paths(TWO_LEVELS), TreeTemplate.from_paths(THREE_SIBLINGS)
  if name == "rows_wor_two_levels":  # siblings without replacement at both depths
    return dense, RowDrafter(two_levels, _softmax(noise), without_replacement=True)
  if name == "rows_wor_draft_ids":  # 2 of the 3 draft ids drawn at each parent
    return sparse, RowDrafter(two_levels, _softmax(noise[..., :3]), True, DRAFT_IDS)
  if name == "rows_iid_draft_ids":
    return dense, RowDrafter(two_levels, _softmax(noise[..., :3]), False, DRAFT_IDS)
  if name == "kseq_two_levels":
    return dense, RowDrafter(two_levels, _softmax(noise))
  if name == "kseq_three_siblings_draft_ids":
    return sparse, RowDrafter(three, _softmax(2 * noise[..., :3]), False, DRAFT_IDS)
  if name == "kseq_q_equals_p":
    return sparse, RowDrafter(two_levels, sparse)
  if name == "kseq_adversarial_q":  # q's mass sits mostly where p = 0: beta is small
    return sparse, RowDrafter(two_levels, _softmax(np.where(sparse == 0, 3.0, -1.0) + noise))
  if name == "kseq_chain3":  # one child per node: k = 1, rho = 1, the single-draft rule
    return dense, SampledDrafter(chain3, _softmax(rng.normal(size=(POS, V, V))))
  if name == "typical_peaked_q":
    return dense, RowDrafter(two_levels, _softmax(3 * noise))
  raise KeyError(name)


TWO_LEVELS = [(0,), (1,), (0, 0), (0, 1)]  # two siblings at depth 1 and below the first
THREE_SIBLINGS = [(0,), (1,), (2,), (0, 0)]
DRAFT_IDS = [3, 0, 4]  # a reduced draft vocabulary: target ids 1 and 2 have q = 0
SAMPLED = ["chain3_random_q", "chain2_q_close_to_p", "chain3_q_equals_p", "chain2_one_hot_q",
           "chain2_adversarial_q", "tree_iid_siblings", "tree_without_replacement"]
DETERMINISTIC = ["top2_then_chains", "top3_sparse_target", "duplicate_siblings", "random_template"]
ROWS = ["rows_wor_two_levels", "rows_wor_draft_ids", "rows_iid_draft_ids"]  # DraftDist rows
KSEQ = ["kseq_two_levels", "kseq_three_siblings_draft_ids", "kseq_q_equals_p",
        "kseq_adversarial_q", "kseq_chain3"]
RULE_OF = dict.fromkeys(KSEQ, verify.Rule("kseq")) | {"typical_peaked_q": verify.Rule("typical")}


# ================================================================================================
# 1. White-box: the one-node step with injected uniforms


def _random_dists(rng, b, v, p_zero=0.3):
  x = rng.gamma(0.5, size=(b, v)) * (rng.random((b, v)) > p_zero)
  x[:, 0] += (x.sum(-1) == 0)
  return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def test_try_node_rule_is_u_q_below_p_and_residual_max_p_minus_q():
  """For random p, q (with zeros), tokens and uniforms: accepted == (u * q(x) < p(x)) bitwise in
  float32, and the rejected residual is max(p - q, 0) exactly."""
  rng = np.random.default_rng(0)
  b, v = 2000, 7
  p, q = _random_dists(rng, b, v), _random_dists(rng, b, v)
  x = rng.integers(0, v, b)
  u = rng.random(b).astype(np.float32)
  acc, res = jax.vmap(verify.try_node)(p, x, q, u)
  rows = np.arange(b)
  np.testing.assert_array_equal(acc, u * q[rows, x] < p[rows, x])
  np.testing.assert_array_equal(res, np.maximum(p - q, np.float32(0)))
  assert 0.1 < np.mean(acc) < 0.9  # both branches exercised


def test_rejection_residual_is_normalised_max_p_minus_q():
  """Through walk() on one sampled node: after a rejection the bonus distribution is
  normalize(max(p - q, 0)); after an acceptance it is p at the node (row 1)."""
  rng = np.random.default_rng(1)
  b = 500
  p = np.stack([_random_dists(rng, b, V), _random_dists(rng, b, V)], 1)
  q = _random_dists(rng, b, V)
  x = np.array([rng.choice(V, p=qi / qi.sum()) for qi in q.astype(np.float64)])
  u = rng.random((b, 1)).astype(np.float32)
  acc, cur, res = walk(trees.chain(x[:, None], q=q[:, None]), p, u)
  acc = np.asarray(acc)[:, 0]
  want = np.maximum(p[:, 0].astype(np.float64) - q, 0)
  want = want / want.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(res)[~acc], want[~acc], atol=1e-6)
  np.testing.assert_array_equal(np.asarray(res)[acc], p[acc, 1])
  np.testing.assert_array_equal(cur, acc.astype(int))
  assert acc.sum() > 50 and (~acc).sum() > 50


def test_acceptance_probability_is_sum_min_and_integrates_the_rule():
  """acceptance_probability(p, q) = sum min(p, q); integrating try_node's decision over a fine
  grid of u and over x ~ q gives the same number (to the grid's resolution 1/M)."""
  rng = np.random.default_rng(2)
  p, q = _random_dists(rng, 20, V), _random_dists(rng, 20, V)
  got = np.asarray(verify.acceptance_probability(p, q))
  np.testing.assert_allclose(got, np.minimum(p, q).sum(-1), rtol=1e-6)
  m = 4096
  u = ((np.arange(m) + 0.5) / m).astype(np.float32)
  step = jax.vmap(jax.vmap(jax.vmap(verify.try_node, (None, None, None, 0)),  # over u
                           (None, 0, None, None)), (0, None, 0, None))  # over x, over rows
  acc, _ = step(p, np.arange(V), q, u)  # [20, V, M]
  integrated = (np.asarray(acc).mean(-1) * q).sum(-1)
  np.testing.assert_allclose(integrated, got, atol=2.0 / m)


U_EXTREMES = np.array([0.0, 0.5, np.nextafter(np.float32(1), np.float32(0))], np.float32)


def test_p_equals_q_always_accepts():
  """p == q: every token with q(x) > 0 is accepted for every u in [0, 1), including the largest
  float32 below 1 (acceptance probability exactly 1, no rounding loss)."""
  rng = np.random.default_rng(3)
  p = _random_dists(rng, 50, V)
  for x in range(V):
    for u in U_EXTREMES:
      acc, _ = jax.vmap(verify.try_node, (0, None, 0, None))(p, x, p, u)
      np.testing.assert_array_equal(acc, p[:, x] > 0)
  np.testing.assert_allclose(verify.acceptance_probability(p, p), 1.0, atol=1e-6)


def test_p_zero_never_accepts_and_q_zero_never_divides():
  """p(x) = 0 is never accepted (any u, whatever q(x)); q(x) = 0 with p(x) > 0 is accepted with
  probability 1 (the ratio is +inf) without a division: no NaN anywhere."""
  p = np.array([0.0, 0.5, 0.5, 0.0, 0.0], np.float32)
  q = np.array([0.4, 0.0, 0.6, 0.0, 0.0], np.float32)
  for u in U_EXTREMES:
    for x, want in [(0, False), (3, False), (1, True)]:  # q(0) > 0 = p(0); q(3) = p(3) = 0
      acc, res = verify.try_node(p, x, q, u)
      assert bool(acc) == want and np.all(np.isfinite(res))


def test_one_hot_q_accepts_with_probability_p_x():
  """q one-hot at x (an argmax drafter, or a deterministic child): accept iff u < p(x); the
  residual is p with x removed, renormalised (recursive rejection = SpecInfer with one-hot q)."""
  p = np.array([0.1, 0.3, 0.2, 0.4, 0.0], np.float32)
  for u in np.linspace(0, 0.99, 23, dtype=np.float32):
    acc, res = verify.try_node(p, 1, _one_hot(1).astype(np.float32), u)
    assert bool(acc) == (u < p[1])
    np.testing.assert_allclose(np.asarray(res) / np.sum(res), [1 / 7, 0, 2 / 7, 4 / 7, 0],
                               rtol=1e-6)


def test_deterministic_siblings_recursive_rejection():
  """Deterministic siblings at p(root) = [0.5, 0.5, 0, 0, 0]: rejecting token 0 leaves r = [0, 1,
  ...], so a later sibling 1 is accepted with certainty; a duplicate sibling 0 can never be
  accepted, and the bonus then is 1 (all the mass left)."""
  p = np.zeros((1, 3, V), np.float32)
  p[0, 0, :2] = 0.5
  p[0, 1:] = 0.2
  u = np.array([[0.75, 0.9999]], np.float32)  # u > 0.5: the first sibling is rejected
  out = accept_u(TreeTemplate.full((2,)).tree([[0, 1]]), p, u, jax.random.key(0))
  assert int(out.n_accepted[0]) == 1 and out.tokens[0, 0] == 1 and out.path[0, 1] == 2
  for key in range(20):
    out = accept_u(TreeTemplate.full((2,)).tree([[0, 0]]), p, u, jax.random.key(key))
    assert int(out.n_accepted[0]) == 0 and out.tokens[0, 0] == 1


def test_numerically_empty_residual_falls_back_to_p():
  """A residual with (numerically) no mass -- p == q up to rounding and a rejected token that
  neither gives probability -- is replaced by p at the current node: finite, normalised, and the
  bonus is a token of p's support, never NaN, never an id >= V."""
  p = np.array([0.0, 0.25, 0.25, 0.5, 0.0], np.float32)
  near = p.copy()  # q one float32 ulp away from p: a residual of mass 2^-26 << EMPTY_MASS
  near[1], near[3] = np.nextafter(p[1], 0), np.nextafter(p[3], 1)
  for q in (p, near):
    b = 200
    tree = trees.chain(np.zeros((b, 1), int), q=np.broadcast_to(q, (b, 1, V)))  # token 0: p=q=0
    rows = np.broadcast_to(p, (b, 2, V))
    _, _, res = walk(tree, rows, np.full((b, 1), 0.3, np.float32))
    np.testing.assert_array_equal(res, rows[:, 0])
    out = accept_u(tree, rows, np.full((b, 1), 0.3, np.float32), jax.random.key(1))
    bonus = np.asarray(out.tokens[:, 0])
    assert np.all(out.n_accepted == 0) and set(bonus) <= {1, 2, 3} and len(set(bonus)) == 3


def test_bonus_never_outside_support_or_vocab():
  """The bonus is drawn from log(residual) as logits: an id with zero residual (here all but the
  last id, V - 1) is never drawn, whatever the key."""
  b = 1000
  p = np.zeros((b, 1, V), np.float32)
  p[:, 0, V - 1] = 1.0
  out = accept_u(Tree.empty(b), p, np.zeros((b, 0), np.float32), jax.random.key(0))
  np.testing.assert_array_equal(out.tokens[:, 0], V - 1)


def test_invalid_nodes_are_never_tried():
  """An invalid node whose token the target is sure of (p(x) = 1) is still not accepted, nor are
  its (invalid) children; the valid sibling after it is tried instead."""
  p = np.zeros((1, 4, V), np.float32)
  p[:, :, 2] = 1.0
  tree = TreeTemplate.from_paths([(0,), (1,), (0, 0)]).tree([[2, 2, 2]], valid=[[0, 1, 0]])
  out = accept_u(tree, p, np.zeros((1, 3), np.float32), jax.random.key(0))
  np.testing.assert_array_equal(out.accepted_node, [[False, True, False]])
  np.testing.assert_array_equal(out.path, [[0, 2, 0, 0]])


# ================================================================================================
# 2. Greedy == brute-force argmax walk


def _brute_greedy(tokens, parent, valid, logits):
  """Walk from the root, take the first valid child equal to argmax of the current row."""
  node, acc = -1, []
  while True:
    best = int(np.argmax(logits[node + 1]))
    nxt = [c for c in range(len(tokens)) if valid[c] and parent[c] == node and tokens[c] == best]
    if not nxt:
      return acc, best
    node = nxt[0]
    acc.append(node)


def _random_forest(rng, b, n, v, p_invalid=0.15):
  """b rows, each its own random template of n nodes (depth <= 4) with random tokens in [0, v)
  and random invalid subtrees: (tokens, parent, depth, valid) as [b, n] numpy arrays."""
  parent, depth = np.zeros((b, n), np.int32), np.zeros((b, n), np.int32)
  for r in range(b):
    tpl = TreeTemplate.from_paths(_random_paths(rng, n))
    parent[r], depth[r] = tpl.parent, tpl.depth
  valid = rng.random((b, n)) > p_invalid
  for i in range(n):
    has_parent = parent[:, i] >= 0
    valid[has_parent, i] &= valid[has_parent, parent[has_parent, i]]
  return rng.integers(0, v, (b, n)), parent, depth, valid


@pytest.mark.parametrize("sampled_q", [False, True])
def test_greedy_equals_brute_force_walk(sampled_q):
  """T = 0 on random trees (a different random template per row, invalid subtrees, vocab 3 so
  duplicate siblings and matches are common, integer logits so argmax ties are common): accepted
  nodes, path, tokens and bonus equal the brute-force walk taking the child equal to the argmax
  (ties: first index, as jnp.argmax). With a random q (a sampled tree verified greedily) the
  result is the same."""
  rng = np.random.default_rng(5 + sampled_q)
  v, b, n = 3, 400, 12
  tokens, parent, depth, valid = _random_forest(rng, b, n, v)
  q = _random_dists(rng, b * n, v, p_zero=0.0).reshape(b, n, v) if sampled_q else None
  logits = rng.integers(0, 3, (b, n + 1, v)).astype(np.float32)
  tree = Tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parent), jnp.asarray(depth),
              jnp.asarray(valid), None if q is None else trees.per_node(q))
  out = jax.tree.map(np.asarray, verify.accept(tree, logits, SamplingConfig(), jax.random.key(1)))
  for r in range(b):
    acc, bonus = _brute_greedy(tokens[r], parent[r], valid[r], logits[r])
    k = len(acc)
    assert out.n_accepted[r] == k
    np.testing.assert_array_equal(out.path[r], [0] + [a + 1 for a in acc] + [0] * (n - k))
    np.testing.assert_array_equal(out.tokens[r], list(tokens[r, acc]) + [bonus] + [0] * (n - k))
    assert set(np.nonzero(out.accepted_node[r])[0]) == set(acc)
  assert np.bincount(out.n_accepted).size >= 4  # paths of several depths were walked


def test_greedy_shortcut_equals_the_scan():
  """`accept` takes `accept_greedy` (masks, no scan) at T = 0: on random trees with duplicate
  siblings, invalid subtrees and argmax ties, every field equals the general scan's
  (`accept_with_uniforms` on the one-hot p, random uniforms), which the sampled tests check."""
  rng = np.random.default_rng(11)
  v, b, n = 3, 300, 10
  tokens, parent, depth, valid = _random_forest(rng, b, n, v)
  logits = rng.integers(0, 3, (b, n + 1, v)).astype(np.float32)
  tree = Tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parent), jnp.asarray(depth),
              jnp.asarray(valid))
  fast = verify.accept_greedy(tree, jnp.asarray(logits))
  p = target_probs(jnp.asarray(logits), SamplingConfig())
  scan = accept_u(tree, p, rng.random((b, n)).astype(np.float32), jax.random.key(0), greedy=True)
  for name in ("n_accepted", "path", "tokens", "accepted_node"):
    np.testing.assert_array_equal(getattr(fast, name), getattr(scan, name), err_msg=name)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_shortcuts_equal_the_general_tree(temperature):
  """A chain (`Tree.chain`) is accepted by prefix (greedy: the matching prefix; both: no sort to
  pack the path): every field equals the general tree code's on the same nodes, with invalid
  nodes and argmax ties, greedy and sampled (same keys)."""
  rng = np.random.default_rng(12)
  v, b, n = 3, 300, 7
  tokens = rng.integers(0, v, (b, n))
  chain = trees.chain(tokens, valid=rng.random((b, n)) < 0.9)
  general = Tree(chain.tokens, chain.parent, chain.depth, chain.valid)
  logits = jnp.asarray(rng.integers(0, 3, (b, n + 1, v)).astype(np.float32))
  sampling, key = SamplingConfig(temperature=temperature), jax.random.key(3)
  fast, slow = verify.accept(chain, logits, sampling, key), verify.accept(general, logits,
                                                                         sampling, key)
  for name in ("n_accepted", "path", "tokens", "accepted_node"):
    np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name), err_msg=name)
  assert len(np.unique(fast.n_accepted)) >= 4


def _random_paths(rng, n, max_depth=4):
  paths, kids = [], {(): 0}
  for _ in range(n):
    options = [p for p in kids if len(p) < max_depth]
    par = options[rng.integers(len(options))]
    paths.append(par + (kids[par],))
    kids[par] += 1
    kids[paths[-1]] = 0
  return paths


# ================================================================================================
# 3. Exact enumeration: the rule's law equals the target's law


@pytest.mark.parametrize("name", SAMPLED + DETERMINISTIC + ROWS + KSEQ)
def test_exact_law_equals_target_law(name):
  """The exact law of the first 3 emitted tokens (and, marginalised, the first 2), computed by the
  independent reference over every draft outcome (weighted by its q-probability) and every accept
  decision, equals p(x1) p(x2|x1) p(x3|x1,x2) to 1e-6. This is the losslessness theorem checked
  on position- and prefix-dependent targets, for sampled and deterministic drafts; for siblings
  sharing a row drawn without replacement (every ordered draw enumerated, the reference
  removing the earlier siblings' tokens itself), over a reduced draft vocabulary; and for
  SpecTr's K-SEQ at every node of i.i.d. children (rho by float64 root finding)."""
  P, drafter = make_problem(name)
  rule, last0 = RULE_OF.get(name, verify.RECURSIVE), 2
  law3 = _law_array(exact_first_k_law(drafter, P, 3, last0, rule), 3)
  want3 = target_law(P, 3, last0)
  np.testing.assert_allclose(law3, want3, atol=1e-6, rtol=0)
  law2 = _law_array(exact_first_k_law(drafter, P, 2, last0, rule), 2)
  np.testing.assert_allclose(law2, want3.sum(-1), atol=1e-6, rtol=0)
  np.testing.assert_allclose(law3.sum(-1), law2, atol=1e-6, rtol=0)


def test_q_equals_p_accepts_every_draft():
  """Drafting from the target itself, the whole chain is accepted with probability exactly 1 at
  every context (the round always emits G + 1 tokens)."""
  P, drafter = make_problem("chain3_q_equals_p")
  for c, last in [(0, 0), (1, 3), (2, 4)]:
    law = exact_round_law(drafter, P, c, last)
    assert sum(pr for seq, pr in law.items() if len(seq) == 4) == pytest.approx(1.0, abs=1e-12)


def test_reference_detects_a_lossy_rule(monkeypatch):
  """Sanity check of the harness itself: a known-wrong rule (accept with min(1, p/q) but, after a
  rejection, keep drawing from r instead of the residual max(r - q, 0)) gives a law far from the
  target's, so the exact test has teeth."""
  P, drafter = make_problem("chain3_random_q")
  monkeypatch.setitem(globals(), "ref_residual", lambda r, q, fallback: r / r.sum())
  law = _law_array(exact_first_k_law(drafter, P, 2, 2), 2)
  assert np.abs(law - target_law(P, 2, 2)).max() > 1e-2


def _tree_and_q(drafter, tokens, q, valid):
  """The library's tree for a drafter's draws, and the reference's q for it (per-node rows over
  target ids, or None for deterministic children)."""
  if isinstance(q, trees.DraftDist):
    return drafter.tpl.tree(tokens, valid=valid, draft=q), drafter.node_rows(q)
  return drafter.tpl.tree(tokens, q=q, valid=valid), None if q is None else q.astype(np.float64)


def test_reference_detects_dropped_removal_and_kseq_residual(monkeypatch):
  """The harness has teeth for the new rules too: trying siblings drawn without replacement as if
  they were i.i.d. (each against its parent's row, the earlier siblings' tokens not removed), or
  drawing K-SEQ's bonus from p instead of its residual, gives a law of the first two tokens far
  from the target's."""
  P, drafter = make_problem("rows_wor_two_levels")
  ok = _law_array(exact_first_k_law(drafter, P, 2, 2), 2)
  want = target_law(P, 2, 2)
  np.testing.assert_allclose(ok, want, atol=1e-6, rtol=0)
  sibling_q = _sibling_q
  with monkeypatch.context() as m:
    m.setitem(globals(), "_sibling_q", lambda tokens, q, kids, j, wor=False:
              sibling_q(tokens, q, kids, j, False))
    assert np.abs(_law_array(exact_first_k_law(drafter, P, 2, 2), 2) - want).max() > 1e-2
  P, drafter = make_problem("kseq_two_levels")
  kseq = verify.Rule("kseq")
  trials = ref_trials
  monkeypatch.setitem(globals(), "ref_trials", lambda rule, tokens, kids, q, pn, wor=False:
                      (trials(rule, tokens, kids, q, pn, wor)[0], pn))
  law = _law_array(exact_first_k_law(drafter, P, 2, 2, kseq), 2)
  assert np.abs(law - target_law(P, 2, 2)).max() > 1e-2


def test_typical_acceptance_is_lossy_by_exact_law():
  """Medusa's typical acceptance is not lossless, so `Rule('typical').lossy` is honest: with a
  flat target (p = 1/V everywhere, above the threshold min(0.09, 0.3 exp(-H)) = 0.06) and a
  drafter peaked on token 0 (q(0) = 0.9), every draft is accepted, so the first token is 0 with
  probability about 0.9 instead of 0.2: the exact law of the first two tokens is at total
  variation > 0.5 from the target's. The same drafter under recursive rejection is exact."""
  P = np.full((POS, V, V), 1.0 / V)
  Q = np.full((POS, V, V), 0.1 / (V - 1))
  Q[..., 0] = 0.9
  drafter = RowDrafter(TreeTemplate.from_paths(TWO_LEVELS), Q)
  want = target_law(P, 2, 1)
  typical = verify.Rule("typical")
  assert typical.lossy and not verify.Rule("kseq").lossy and not verify.RECURSIVE.lossy
  law = _law_array(exact_first_k_law(drafter, P, 2, 1, typical), 2)
  assert 0.5 * np.abs(law - want).sum() > 0.5
  np.testing.assert_allclose(law.sum(), 1.0, atol=1e-9)  # a distribution, just not the target's
  exact = _law_array(exact_first_k_law(drafter, P, 2, 1), 2)
  np.testing.assert_allclose(exact, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rule", verify.RULES)
def test_greedy_every_rule_is_the_argmax_walk(rule):
  """At temperature 0 (SamplingConfig()) every rule accepts exactly the brute-force argmax walk
  (random trees with sampled i.i.d. rows, argmax ties, invalid subtrees); typical acceptance's
  own scan does too on one-hot targets (p(argmax) = 1 > its threshold, every other p = 0)."""
  rule = verify.Rule(rule)
  rng = np.random.default_rng(21)
  v, b, n = 3, 100, 10
  tokens, parent, depth, valid = _random_forest(rng, b, n, v)
  q = _random_dists(rng, b * n, v, p_zero=0.0).reshape(b, n, v)
  logits = rng.integers(0, 3, (b, n + 1, v)).astype(np.float32)
  tree = Tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parent), jnp.asarray(depth),
              jnp.asarray(valid), trees.per_node(q))
  out = jax.tree.map(np.asarray, verify.accept(tree, logits, SamplingConfig(), jax.random.key(1),
                                               rule=rule))
  scan = None
  if rule.name == "typical":
    onehot = np.asarray(target_probs(jnp.asarray(logits), SamplingConfig()))
    scan = [np.asarray(x) for x in walk(tree, onehot, rng.random((b, n)).astype(np.float32),
                                        rule=rule)]
  for r in range(b):
    acc, bonus = _brute_greedy(tokens[r], parent[r], valid[r], logits[r])
    k = len(acc)
    assert out.n_accepted[r] == k
    np.testing.assert_array_equal(out.tokens[r], list(tokens[r, acc]) + [bonus] + [0] * (n - k))
    assert set(np.nonzero(out.accepted_node[r])[0]) == set(acc)
    if scan is not None:
      assert set(np.nonzero(scan[0][r])[0]) == set(acc)
      np.testing.assert_array_equal(scan[2][r], _one_hot(bonus, v))
  assert np.bincount(out.n_accepted).size >= 3


def _recursive_iid_acceptance(p, q, k):
  """P(recursive rejection accepts one of k i.i.d. drafts from q): 1 - prod_i (1 - sum min(r_i,
  q)), r_0 = p, r_{i+1} = normalize(max(r_i - q, 0)) (the reference's residual; with i.i.d.
  siblings it does not depend on the tokens drawn, so this product is exact)."""
  r, reject = p / p.sum(), 1.0
  for _ in range(k):
    reject *= 1.0 - np.minimum(r, q).sum()
    r = ref_residual(r, q, p)
  return 1.0 - reject


def test_kseq_rho_is_spectr_rho_and_accepts_at_least_recursive_rejection():
  """verify.kseq_rho on random p, q (with zeros) and k in 1..5: rho in [1, k], exactly 1 for k =
  1; beta = sum min(q, p / rho); the bound 1 - (1 - beta)^k <= rho beta holds (float32 rounding
  allowed); rho is the smallest such: its acceptance probability a = 1 - (1 - beta)^k is the
  float64 root's to 1e-6, and rho is the root to 1e-5 where beta > 0.05 (for a tiny beta the
  root is only determined to about eps / beta, and so is nothing that depends on it). a then
  satisfies, as it must:
    * a >= sum min(p, q) (one draft's): rho beta = sum min(rho q, p) >= sum min(q, p);
    * a <= 1 - (1 - sum min(p, q))^k: beta(rho) <= beta(1);
    * a >= recursive rejection's acceptance with the same k i.i.d. drafts. Proof: with g(s) =
      sum min(p, s q) (concave, g(0) = 0), recursive rejection's unnormalised residual after i
      rejections is (p - S_i q)^+, S_0 = 0, S_{i+1} = S_i + 1 - g(S_i), and it accepts g(S_k);
      K-SEQ with rho > 1 accepts g(rho) = rho beta with rho = sum_{j<k} (1 - beta)^j, and g(s)
      >= beta s for s <= rho gives S_{i+1} <= 1 + (1 - beta) S_i, so S_k <= rho by induction
      (rho = 1 with k >= 2 only when beta is 0 or 1, where both accept alike).
  On a few one-level trees, the reference's exact K-SEQ law accepts with probability a and
  recursive rejection's law with the closed form above."""
  rng = np.random.default_rng(17)
  m = 300
  p, q = _random_dists(rng, m, V), _random_dists(rng, m, V)
  k = rng.integers(1, 6, m)
  rho, beta = map(np.asarray, verify.kseq_rho(jnp.asarray(p), jnp.asarray(q), jnp.asarray(k)))
  p64, q64, rho64 = p.astype(np.float64), q.astype(np.float64), rho.astype(np.float64)
  assert np.all((1 <= rho) & (rho <= k)) and np.all(rho[k == 1] == 1.0)
  beta64 = np.minimum(q64, p64 / rho64[:, None]).sum(-1)
  np.testing.assert_allclose(beta, beta64, atol=1e-6)
  acc = 1.0 - (1.0 - beta64) ** k
  assert np.all(acc <= rho64 * beta64 + 1e-6)
  ref = np.array([ref_kseq_rho(p64[i], q64[i], k[i]) for i in range(m)])
  beta_ref = np.minimum(q64, p64 / ref[:, None]).sum(-1)
  np.testing.assert_allclose(acc, 1.0 - (1.0 - beta_ref) ** k, atol=1e-6)  # the optimum's
  well_posed = beta_ref > 0.05  # rho beta - (1 - (1 - beta)^k) = O(beta^2): rho ~ eps / beta
  np.testing.assert_allclose(rho64[well_posed], ref[well_posed], atol=1e-5)
  assert np.sum(ref > 1.01) > m // 3 and well_posed.mean() > 0.6  # roots, not only the ends
  single = np.minimum(p64, q64).sum(-1)
  assert np.all(acc >= single - 1e-6)
  assert np.all(acc <= 1.0 - (1.0 - single) ** k + 1e-6)
  recursive = np.array([_recursive_iid_acceptance(p64[i], q64[i], k[i]) for i in range(m)])
  assert np.all(acc >= recursive - 1e-6)
  assert np.sum(acc > recursive + 1e-3) > m // 4  # strictly more, often
  for i in range(6):  # exact laws of one-level trees of kk <= 3 i.i.d. children
    kk = min(int(k[i]), 3)
    drafter = RowDrafter(TreeTemplate.full((kk,)), np.broadcast_to(q64[i], (POS, V, V)))
    P = np.broadcast_to(p64[i], (POS, V, V))
    _, b_kk = verify.kseq_rho(jnp.asarray(p[i]), jnp.asarray(q[i]), jnp.asarray(kk))
    for rule, want in ((verify.Rule("kseq"), 1.0 - (1.0 - float(b_kk)) ** kk),
                       (verify.RECURSIVE, _recursive_iid_acceptance(p64[i], q64[i], kk))):
      law = exact_round_law(drafter, P, 0, 0, rule)
      assert sum(pr for seq, pr in law.items() if len(seq) == 2) == pytest.approx(want, abs=1e-6)


# The q of a pruned tree's instance: its root keeps a second child for some first draws only.
PRUNED_P = np.array([0.003, 0.047, 0.489, 0.461])
PRUNED_Q = np.array([0.009, 0.458, 0.492, 0.041])
PRUNED_BELOW = np.array([[0.120, 0.355, 0.048, 0.477], [0.013, 0.013, 0.963, 0.011],
                         [0.213, 0.056, 0.710, 0.021], [0.219, 0.577, 1e-7, 0.204]])


def _pruned_keeps_second(x1):
  """EAGLE-2's depth-2, top-2, 2-node tree keeps the root's second draw iff its slot's score
  log q_(2) is at least the first draw's best child's, log q_(1) + log max q(. | x1) (the
  earlier candidate wins a tie)."""
  lq = np.log(np.sort(PRUNED_Q)[::-1])
  return lq[1] >= lq[0] + np.log(PRUNED_BELOW[x1].max())


def test_kseq_is_lossy_on_trees_pruned_by_their_draws_and_is_refused_there():
  """K-SEQ needs each node's number of children k fixed before they are drawn: rho depends on
  k, so a k that depends on a draft's own token tests that draft against a rho chosen by it.
  EAGLE-2's pruned tree does that: with depth 2, top_k 2 and 2 nodes, the root keeps its
  second draw only for some first draws x1 (those whose own q(. | x1) is flat,
  `_pruned_keeps_second`; checked here against grow_dynamic_tree's shapes over 4000 rows).
  Exactly (every x1, x2, y1 enumerated, the reference's rules), K-SEQ's law of the first token
  is at total variation > 0.05 from p, recursive rejection's is p to 1e-9. So such trees carry
  counts_fixed = False and verify refuses K-SEQ on them (a jitted accept fails to trace), and
  `check_children` refuses such drafters before compiling (EAGLE's, DFlash's corrected tree);
  a tree keeping every candidate, one child per node, `tree_from_marginals` (no score reads a
  token) and static templates keep it."""
  v = len(PRUNED_P)
  p_rows = np.full((3, v), 1.0 / v)
  p_rows[0] = PRUNED_P
  first = {verify.RECURSIVE: np.zeros(v), verify.Rule("kseq"): np.zeros(v)}
  for x1 in range(v):
    second = [(x, PRUNED_Q[x], [-1, -1], [PRUNED_Q, PRUNED_Q]) for x in range(v)]
    below = [(y, PRUNED_BELOW[x1, y], [-1, 0], [PRUNED_Q, PRUNED_BELOW[x1]]) for y in range(v)]
    for x, w, parent, q in second if _pruned_keeps_second(x1) else below:
      for rule, law in first.items():
        for seq, pr in ref_round_law([x1, x], parent, [True, True], np.asarray(q), p_rows,
                                     rule).items():
          law[seq[0]] += PRUNED_Q[x1] * w * pr
  assert {_pruned_keeps_second(x) for x in range(v)} == {True, False}
  np.testing.assert_allclose(first[verify.RECURSIVE], PRUNED_P, atol=1e-9)
  assert 0.5 * np.abs(first[verify.Rule("kseq")] - PRUNED_P).sum() > 0.05

  b, iid, sampling = 4000, Children("iid"), SamplingConfig(1.0)
  below = jnp.log(jnp.asarray(PRUNED_BELOW, jnp.float32))

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def grow(num_nodes, top_k=2):
    root = jnp.broadcast_to(jnp.log(jnp.asarray(PRUNED_Q, jnp.float32)), (b, v))
    return trees.grow_dynamic_tree(root, lambda carry, tokens, parent, level: (below[tokens],
                                   carry), (), depth=2, top_k=top_k, num_nodes=num_nodes,
                                   children=iid, sampling=sampling, key=jax.random.key(3))[0].tree

  pruned = grow(2)
  keeps = np.asarray(pruned.parent[:, 1]) == -1
  np.testing.assert_array_equal(keeps, [_pruned_keeps_second(x) for x in
                                        np.asarray(pruned.tokens[:, 0])])
  assert 0 < keeps.mean() < 1 and not pruned.draft.counts_fixed
  logits = jnp.log(jnp.broadcast_to(jnp.asarray(p_rows, jnp.float32), (b, 3, v)))
  key, kseq = jax.random.key(0), verify.Rule("kseq")
  traced = functools.partial(jax.eval_shape, verify.accept)  # traces (and checks), no compile
  with pytest.raises(ValueError, match="fixed before they are drawn"):
    traced(pruned, logits, sampling, key, kseq)
  traced(pruned, logits, sampling, key)  # recursive rejection is lossless on it
  traced(pruned, logits, SamplingConfig(), key, kseq)  # greedy: every rule is argmax matching
  for tree in (jax.eval_shape(grow, 6), jax.eval_shape(grow, 2, 1)):  # all kept; chains
    assert tree.draft.counts_fixed
  marginals = jnp.log(jnp.broadcast_to(jnp.asarray(PRUNED_BELOW[:2], jnp.float32), (b, 2, v)))
  grown = jax.eval_shape(lambda m: trees.tree_from_marginals(
      m, num_nodes=2, top_k=2, children=iid, sampling=sampling, key=key), marginals)
  assert grown.tree.draft.counts_fixed
  assert (trees.grown_counts_fixed(2, 2, 2), trees.grown_counts_fixed(2, 2, 6),
          trees.grown_counts_fixed(3, 1, 3)) == (False, True, True)
  with pytest.raises(ValueError, match="fixed before they are drawn"):
    verify.check_children(kseq, "iid", counts_fixed=False)
  verify.check_children(kseq, "iid")
  verify.check_children(verify.RECURSIVE, "iid", counts_fixed=False)
  eagle = functools.partial(EagleDrafter, params=None, d2t=None, head=None, module=object,
                            net=None, depth=2, top_k=2)
  assert not eagle(total_tokens=2).counts_fixed and eagle(total_tokens=6).counts_fixed
  dflash = functools.partial(DFlashDrafter, params=None, d2t=None, head=None, depth=2, top_k=2,
                             total_tokens=2)
  assert not dflash(net=SimpleNamespace(correction_rank=1)).counts_fixed
  assert dflash(net=SimpleNamespace(correction_rank=0)).counts_fixed


STEP_BY_STEP = SAMPLED + DETERMINISTIC + ROWS[:2] + KSEQ[:2] + ["typical_peaked_q"]


@pytest.mark.parametrize("name", STEP_BY_STEP)
def test_decisions_match_reference_step_by_step(name):
  """verify.walk / accept_with_uniforms against ref_walk on the same draws and injected uniforms
  (each scenario's rule): the same nodes accepted, the same bonus distribution (to 1e-5), and
  path / tokens built from them. Rows are drawn at random contexts from each scenario; a uniform
  within 1e-5 of an accept probability (where float32 and float64 may legitimately disagree) is
  redrawn. Trees drawn without replacement carry one row per parent (`DraftDist`), so the walk's
  own removal of the earlier siblings' tokens is what is checked; K-SEQ's rho is the library's
  float32 bisection against the reference's float64 root."""
  P, drafter = make_problem(name)
  rule = RULE_OF.get(name, verify.RECURSIVE)
  wor = getattr(drafter, "without_replacement", False)
  P32 = P.astype(np.float32)
  rng = np.random.default_rng(7)
  b, tpl = 128, drafter.tpl
  c, last = rng.integers(0, 3, b), rng.integers(0, V, b)
  tokens, q, valid = drafter.sample(rng, c, last)
  tree, q_ref = _tree_and_q(drafter, tokens, q, valid)
  p = np.stack([_target_rows(P32, c[r], tpl.depth, tokens[r], last[r]) for r in range(b)])
  u = rng.random((b, tpl.num_nodes)).astype(np.float32)
  expected = []
  for r in range(b):
    q_r = None if q_ref is None else q_ref[r]
    while True:
      acc, res, margin = ref_walk(tokens[r], tpl.parent, valid[r], q_r, p[r].astype(np.float64),
                                  u[r].astype(np.float64), rule, wor)
      if margin > 1e-5:
        break
      u[r] = rng.random(tpl.num_nodes)
    expected.append((acc, res))
  got_acc, _, got_res = map(np.asarray, walk(tree, p, u, rule=rule))
  out = jax.tree.map(np.asarray, accept_u(tree, p, u, jax.random.key(0), rule=rule))
  n_acc = [len(a) for a, _ in expected]
  assert len(set(n_acc)) > 1 or name in ("chain3_q_equals_p", "kseq_q_equals_p")
  for r, (acc, res) in enumerate(expected):
    assert set(np.nonzero(got_acc[r])[0]) == set(acc), r
    np.testing.assert_allclose(got_res[r], res, atol=1e-5)
    np.testing.assert_array_equal(out.path[r, 1:len(acc) + 1], np.array(acc) + 1)
    np.testing.assert_array_equal(out.tokens[r, :len(acc)], tokens[r, acc])
    assert res[out.tokens[r, len(acc)]] > 0  # the bonus comes from the residual's support


# ================================================================================================
# 4. Monte Carlo of the jitted accept() with real randomness


def chi_square_pvalue(observed: dict, expected: dict, n: int) -> float:
  """Pearson chi-square of counts against exact cell probabilities; cells with expected count
  < 5 are pooled (and the pool joins the smallest cell if still < 5). A count in a cell of
  probability 0 is an immediate failure (e.g. a token outside the top-p support)."""
  impossible = {k: v for k, v in observed.items() if expected.get(k, 0.0) == 0.0}
  assert not impossible, f"outcomes of probability 0 observed: {impossible}"
  cells = [k for k, pr in expected.items() if pr > 0]
  exp = np.array([expected[k] * n for k in cells])
  obs = np.array([observed.get(k, 0) for k in cells], np.float64)
  small = exp < 5
  if small.any():
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    if exp[-1] < 5 and len(exp) > 1:
      j = np.argmin(exp[:-1])
      exp[j] += exp[-1]
      obs[j] += obs[-1]
      exp, obs = exp[:-1], obs[:-1]
  stat = np.sum((obs - exp) ** 2 / exp)
  return float(scipy.stats.chi2.sf(stat, len(exp) - 1)) if len(exp) > 1 else 1.0


def _round(drafter, L, sampling, c, last, rng, key, rule=None):
  """One batched verification round of the jitted accept() at contexts (c[B], last[B])."""
  tokens, q, valid = drafter.sample(rng, c, last)
  tpl = drafter.tpl
  logits = np.concatenate([L[c, last][:, None], L[c[:, None] + tpl.depth, tokens]], axis=1)
  out = verify.accept(_tree_and_q(drafter, tokens, q, valid)[0], logits, sampling, key, rule)
  return np.asarray(out.n_accepted), np.asarray(out.tokens)


def _mc_counts(drafter, L, sampling, last0, k, seed, rule=None):
  """Runs rounds until every row has k tokens. Returns the counts of the first round's outcome
  (first two emitted tokens, or (x1, None) if it emitted one) and of the first k tokens."""
  rng, key = np.random.default_rng(seed), jax.random.key(seed)
  b = MC_ROWS
  emitted = np.zeros((b, k + drafter.tpl.num_nodes + 1), np.int64)
  n = np.zeros(b, np.int64)
  first_round = None
  rows = np.arange(b)
  while n.min() < k:
    c = np.minimum(n, k - 1)  # rows already done re-run harmlessly at a legal position
    last = np.where(n > 0, emitted[rows, np.maximum(n - 1, 0)], last0)
    key, sub = jax.random.split(key)
    n_acc, toks = _round(drafter, L, sampling, c, last, rng, sub, rule)
    if first_round is None:
      first_round = collections.Counter(
          (int(t[0]), int(t[1]) if m >= 1 else None) for t, m in zip(toks, n_acc))
    live = n < k
    for j in range(toks.shape[1]):
      put = live & (j <= n_acc)
      emitted[rows[put], n[put] + j] = toks[put, j]
    n = np.where(live, n + n_acc + 1, n)
  return first_round, collections.Counter(map(tuple, emitted[:, :k].tolist()))


MC_CASES = [
    ("chain2_random_q", SamplingConfig(temperature=1.0)),
    ("chain2_random_q", SamplingConfig(temperature=0.7, top_p=0.9)),
    ("top2_tree", SamplingConfig(temperature=1.0)),
    ("top2_tree", SamplingConfig(temperature=0.7, top_p=0.9)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, sampling", MC_CASES,
                         ids=[f"{n}-T{s.temperature}-p{s.top_p}" for n, s in MC_CASES])
def test_monte_carlo_accept_matches_exact_laws(name, sampling):
  """20000 rows through the jitted accept() with real rng, target p = target_probs(logits,
  sampling) depending on position and previous token. Two chi-square tests at ALPHA:
  (a) the first round's outcome (x1, x2) or (x1, stop) -- includes the bonus -- against the
      reference's exact one-round law; (b) the first two emitted tokens after as many rounds as
      needed against the target's autoregressive law p(x1) p(x2 | x1)."""
  rng = np.random.default_rng(11)
  L = (1.5 * rng.normal(size=(POS, V, V))).astype(np.float32)
  P = np.asarray(target_probs(jnp.asarray(L), sampling), np.float64)
  noise = rng.normal(size=(POS, V, V))
  if name == "chain2_random_q":
    drafter = SampledDrafter(TreeTemplate.chain(2), _softmax(noise).astype(np.float32))
  else:
    drafter = TopKDrafter(TreeTemplate.from_paths(TOP2), noise)
  last0 = 1
  first_round, first2 = _mc_counts(drafter, L, sampling, last0, 2, seed=3)
  exact_round = collections.defaultdict(float)
  for seq, pr in exact_round_law(drafter, P, 0, last0).items():
    exact_round[(seq[0], seq[1] if len(seq) > 1 else None)] += pr
  pval_round = chi_square_pvalue(first_round, exact_round, MC_ROWS)
  want = target_law(P, 2, last0)
  pval_law = chi_square_pvalue(first2, {xs: want[xs] for xs in np.ndindex(want.shape)}, MC_ROWS)
  assert pval_round > ALPHA and pval_law > ALPHA, (pval_round, pval_law)


NEW_RULE_MC_CASES = [
    ("wor_draft_ids", verify.RECURSIVE, SamplingConfig(temperature=1.0)),
    ("kseq_draft_ids", verify.Rule("kseq"), SamplingConfig(temperature=0.7, top_p=0.9)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, rule, sampling", NEW_RULE_MC_CASES,
                         ids=[n for n, _, _ in NEW_RULE_MC_CASES])
def test_monte_carlo_new_rules_match_exact_laws(name, rule, sampling):
  """The jitted accept() with real randomness on trees carrying one row per parent over a
  reduced draft vocabulary (`DraftDist.ids`: q over 3 or 4 of the 5 target ids, the others q =
  0): siblings drawn without replacement at both depths under recursive rejection, and three
  i.i.d. siblings under K-SEQ against a top-p target. The same two chi-square tests at ALPHA as
  above: the first round's outcome against the reference's exact one-round law, and the first
  two tokens against the target's autoregressive law."""
  rng = np.random.default_rng(12)
  L = (1.5 * rng.normal(size=(POS, V, V))).astype(np.float32)
  P = np.asarray(target_probs(jnp.asarray(L), sampling), np.float64)
  noise = rng.normal(size=(POS, V, V))
  if name == "wor_draft_ids":
    drafter = RowDrafter(TreeTemplate.from_paths(TWO_LEVELS),
                         _softmax(noise[..., :3]).astype(np.float32), True, DRAFT_IDS)
  else:
    drafter = RowDrafter(TreeTemplate.from_paths(THREE_SIBLINGS),
                         _softmax(noise[..., :4]).astype(np.float32), False, [3, 0, 4, 1])
  last0 = 1
  first_round, first2 = _mc_counts(drafter, L, sampling, last0, 2, seed=5, rule=rule)
  exact_round = collections.defaultdict(float)
  for seq, pr in exact_round_law(drafter, P, 0, last0, rule).items():
    exact_round[(seq[0], seq[1] if len(seq) > 1 else None)] += pr
  pval_round = chi_square_pvalue(first_round, exact_round, MC_ROWS)
  want = target_law(P, 2, last0)
  pval_law = chi_square_pvalue(first2, {xs: want[xs] for xs in np.ndindex(want.shape)}, MC_ROWS)
  assert pval_round > ALPHA and pval_law > ALPHA, (pval_round, pval_law)


@pytest.mark.slow
def test_monte_carlo_bonus_uniform_not_reused():
  """One deterministic node with p(x) = 0.5: accepted iff its uniform u < 0.5. If the bonus
  reused u (a shipped bug), the bonus after a rejection would only see u >= 0.5 and be biased.
  The joint law of (n_accepted, first bonus) must match the exact one."""
  b = MC_ROWS
  p_root = np.array([0.5, 0.2, 0.1, 0.15, 0.05])
  p_node = np.array([0.1, 0.1, 0.3, 0.3, 0.2])
  logits = np.log(np.broadcast_to(np.stack([p_root, p_node]), (b, 2, V))).astype(np.float32)
  out = verify.accept(trees.chain(np.zeros((b, 1), int)), logits, SamplingConfig(1.0),
                      jax.random.key(4))
  n_acc = np.asarray(out.n_accepted)
  bonus = np.asarray(out.tokens)[np.arange(b), n_acc]
  observed = collections.Counter(zip(n_acc.tolist(), bonus.tolist()))
  residual = np.where(np.arange(V) == 0, 0, p_root) / 0.5
  expected = {(1, y): 0.5 * p_node[y] for y in range(V)}
  expected.update({(0, y): 0.5 * residual[y] for y in range(V)})
  assert chi_square_pvalue(observed, expected, b) > ALPHA


@pytest.mark.slow
def test_empty_tree_bonus_is_sampled_from_p0():
  """N = 0 (autoregressive decoding): n_accepted = 0, path = [0], and the single token follows
  p[0] = target_probs(logits) (T = 0.7, top_p = 0.9: never outside the support) -- chi-square at
  ALPHA; greedy gives the argmax."""
  b = MC_ROWS
  logits = np.array([[1.0, 2.0, 0.5, -1.0, 1.5]], np.float32)
  sampling = SamplingConfig(temperature=0.7, top_p=0.9)
  p0 = np.asarray(target_probs(jnp.asarray(logits), sampling), np.float64)[0]
  out = verify.accept(Tree.empty(b), np.broadcast_to(logits, (b, 1, V)), sampling,
                      jax.random.key(9))
  assert np.all(out.n_accepted == 0) and np.all(out.path == 0) and out.tokens.shape == (b, 1)
  observed = collections.Counter(np.asarray(out.tokens[:, 0]).tolist())
  assert chi_square_pvalue(observed, dict(enumerate(p0)), b) > ALPHA
  greedy = verify.accept(Tree.empty(3), np.broadcast_to(logits, (3, 1, V)), SamplingConfig(),
                         jax.random.key(9))
  np.testing.assert_array_equal(greedy.tokens, [[1]] * 3)


# ================================================================================================
# 5. Consistency of the Acceptance fields


@pytest.mark.parametrize("sampled_q", [False, True])
def test_acceptance_fields_are_consistent(sampled_q):
  """On random trees at T = 1: accepted_node is a root-to-node chain of valid nodes whose depths
  are 1..n_accepted; path = [0, rows of those nodes, 0-padding]; tokens = their tokens, the bonus
  at n_accepted (an id < V), 0-padding; n_accepted <= the tree's max depth."""
  rng = np.random.default_rng(12)
  b, n = 256, 12
  tokens, parent, depth, valid = _random_forest(rng, b, n, V, p_invalid=0.1)
  q = _random_dists(rng, b * n, V, p_zero=0.0).reshape(b, n, V) if sampled_q else None
  logits = (2 * rng.normal(size=(b, n + 1, V))).astype(np.float32)
  tree = Tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parent), jnp.asarray(depth),
              jnp.asarray(valid), None if q is None else trees.per_node(q))
  out = jax.tree.map(np.asarray, verify.accept(tree, logits, SamplingConfig(1.0),
                                               jax.random.key(0)))
  assert out.path.shape == out.tokens.shape == (b, n + 1) and out.accepted_node.shape == (b, n)
  assert out.n_accepted.dtype == out.path.dtype == out.tokens.dtype == np.int32
  for r in range(b):
    acc, k = np.nonzero(out.accepted_node[r])[0], out.n_accepted[r]
    assert len(acc) == k <= depth[r].max() and np.all(valid[r, acc])
    np.testing.assert_array_equal(parent[r, acc], np.concatenate([[-1], acc])[:k])
    np.testing.assert_array_equal(depth[r, acc], np.arange(1, k + 1))
    np.testing.assert_array_equal(out.path[r], np.concatenate([[0], acc + 1, np.zeros(n - k)]))
    np.testing.assert_array_equal(out.tokens[r, :k], tokens[r, acc])
    assert 0 <= out.tokens[r, k] < V and np.all(out.tokens[r, k + 1:] == 0)
  assert np.bincount(out.n_accepted).size >= 3


def test_row_results_do_not_depend_on_batch_size():
  """Each row draws from rng folded with its index: row r of a batch of 3 and of a batch of 8
  (same tree and logits in those rows) gives identical results."""
  rng = np.random.default_rng(13)
  tpl = TreeTemplate.from_paths(TOP2)
  tokens, logits = rng.integers(0, V, (8, 4)), rng.normal(size=(8, 5, V)).astype(np.float32)
  big = verify.accept(tpl.tree(tokens), logits, SamplingConfig(1.0), jax.random.key(5))
  small = verify.accept(tpl.tree(tokens[:3]), logits[:3], SamplingConfig(1.0), jax.random.key(5))
  for a, s in zip(jax.tree.leaves(big), jax.tree.leaves(small)):
    np.testing.assert_array_equal(np.asarray(a)[:3], s)


def test_shape_errors():
  """Target rows must be [B, N + 1, V] (row 0 is the root) and q must share the target's vocab."""
  tree = trees.chain(np.zeros((2, 3), int))
  with pytest.raises(ValueError, match="row 0 is the root"):
    verify.accept(tree, np.zeros((2, 3, V), np.float32), SamplingConfig(1.0), jax.random.key(0))
  sampled = trees.chain(np.zeros((2, 3), int), q=np.full((2, 3, V + 1), 1 / (V + 1)))
  with pytest.raises(ValueError, match="vocab"):
    verify.accept(sampled, np.zeros((2, 4, V), np.float32), SamplingConfig(1.0), jax.random.key(0))
