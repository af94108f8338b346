"""Static trees drafted from the last committed hidden state: what Medusa and Hydra share.

A static tree ("choices", `trees.TreeTemplate`; Cai et al. 2024) is a fixed set of rank paths:
node (r_1, .., r_d) holds the rank-r_d candidate at depth d below its parent. The drafters read
the target's hidden state at the last committed position (`HeadState`), the one whose LM-head
output produced `pending`, and fill the template with their heads' ranked candidates.
`StaticTreeFamily` is the family protocol's shared half for such drafters: one head per depth
(`StaticTreeOptions.num_heads`), trees named in TREES or given as choices.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import checks, trees
from specjax.children import Children, pick
from specjax.config_utils import PosInt, config
from specjax.drafters import learned
from specjax.drafters.base import Prefill, RoundResult, TargetFacts, TargetView
from specjax.sampling import SamplingConfig

# Named trees for 4 heads ("choices"): wide where the heads are sure, deep along rank 0. Which is
# fastest depends on how much a node costs to verify (experiments/tune_tree.py measures it).
TREES = {
    "chain4": ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)),
    "tree6": ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)),
    "tree8": ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)),
    "tree11": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
               (1, 0, 0), (0, 0, 0, 0)),
    "tree15": ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
               (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)),
}
DEFAULT_CHOICES = TREES["tree15"]


def check_template(template: trees.TreeTemplate, num_heads: int, vocab: int) -> None:
  if template.max_depth > num_heads:
    raise ValueError(f"tree depth {template.max_depth} exceeds the drafter's {num_heads} heads")
  if int(template.rank.max()) >= vocab:
    raise ValueError(f"tree rank {int(template.rank.max())} >= draft vocabulary {vocab}")


def template_levels(template: trees.TreeTemplate):
  """Per depth d: (the depth-d nodes, their static parents (-1 = root), each node's parent
  slot among those parents)."""
  levels = []
  for d in range(1, template.max_depth + 1):
    nodes = np.nonzero(template.depth == d)[0]
    parents = sorted(set(int(p) for p in template.parent[nodes]))
    slot = np.asarray([parents.index(int(p)) for p in template.parent[nodes]], np.int32)
    levels.append((nodes, np.asarray(parents, np.int32), slot))
  return levels


def sample_template(template: trees.TreeTemplate, children: Children, sampling: SamplingConfig,
                    key: jax.Array, level_logp: Callable, batch: int
                    ) -> tuple[jax.Array, jax.Array, trees.DraftDist]:
  """A template filled with sampled children, level by level (`specjax.children`).

  level_logp(d, parents, tokens) -> float32[B, P, Vq]: the draft log-probabilities below each of
  the depth-(d - 1) `parents` (static node ids, -1 the root), given the draft ids `tokens`
  [B, N] drawn so far. A parent's i-th child in template order (`TreeTemplate.sibling`) is its
  i-th draw; ranks are not read. Returns (draft ids [B, N], valid [B, N]: a node whose draw found
  q's support exhausted is invalid, and so are its descendants, DraftDist over the draft ids
  with one row per parent)."""
  n = template.num_nodes
  tokens = jnp.zeros((batch, n), jnp.int32)
  valid = jnp.ones((batch, n), bool)
  source = np.zeros(n, np.int32)
  rows = []
  for d, (nodes, parents, slot) in enumerate(template_levels(template), start=1):
    k = int(np.bincount(slot).max())
    picked = pick(children, sampling, jax.random.fold_in(key, d), level_logp(d, parents, tokens),
                  k)
    sib = template.sibling[nodes]
    tokens = tokens.at[:, nodes].set(picked.tokens[:, slot, sib])
    ok = picked.ok[:, slot, sib]
    par = template.parent[nodes]
    if d > 1:
      ok = ok & valid[:, np.maximum(par, 0)]
    valid = valid.at[:, nodes].set(ok)
    source[nodes] = sum(r.shape[1] for r in rows) + slot
    rows.append(picked.q)
  draft = trees.DraftDist(probs=jnp.concatenate(rows, axis=1),
                          source=jnp.broadcast_to(jnp.asarray(source), (batch, n)),
                          without_replacement=children.mode == "wor")
  return tokens, valid, draft


@struct.dataclass
class HeadState:
  feature: jax.Array  # [B, E] target hidden state at the last committed position


def last_feature_at_prefill(prefill: Prefill) -> HeadState:
  """The feature whose LM-head output produced `pending` (the last prompt position)."""
  return HeadState(learned.take_rows(prefill.hidden[0], prefill.hist_len - 2))


def last_feature_after_round(state: HeadState, result: RoundResult) -> HeadState:
  """The feature of the last accepted block row: its logits produced the bonus (new pending)."""
  acc = result.acceptance
  row = jnp.take_along_axis(acc.path, acc.n_accepted[:, None], axis=1)[:, 0]
  feature = learned.take_rows(result.hidden[0], row)
  return HeadState(jnp.where(result.live[:, None], feature, state.feature))


@struct.dataclass
class StaticTreeDrafter(learned.LearnedDrafter):
  """Heads on the last committed hidden state filling a static template (Medusa, Hydra)."""

  # Required (by keyword: the base's fields with defaults come first): the heads' network config
  # and the tree they fill.
  net: object = struct.field(pytree_node=False, kw_only=True)
  template: trees.TreeTemplate = struct.field(pytree_node=False, kw_only=True)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())

  @property
  def num_nodes(self) -> int:
    return self.template.num_nodes

  def init(self, target: TargetView, prefill: Prefill) -> HeadState:
    return last_feature_at_prefill(prefill)

  def update(self, target: TargetView, state: HeadState, result: RoundResult) -> HeadState:
    return last_feature_after_round(state, result)


def parse_choices(choices):
  """Tree paths from a name in TREES, a tuple of paths, or their JSON text (a --set override);
  None stays None (the default tree). Anything else, an empty tree included, is refused: an
  empty list must not silently become the default."""
  if choices is None:
    return None
  what = (f"choices must be a tree name ({', '.join(sorted(TREES))}), a non-empty list of "
          f"rank paths (lists of ints >= 0), or its JSON text, got {choices!r}")
  if isinstance(choices, str):
    if choices in TREES:
      return TREES[choices]
    try:
      choices = json.loads(choices)
    except json.JSONDecodeError:
      raise ValueError(what) from None
  if not isinstance(choices, (list, tuple)) or not choices or not all(
      isinstance(p, (list, tuple)) and p and all(checks.is_int(r) and r >= 0 for r in p)
      for p in choices):
    raise ValueError(what)
  return tuple(tuple(int(r) for r in path) for path in choices)


@config
class StaticTreeOptions(learned.FamilyOptions):
  """The training options of a head-per-depth family."""

  num_heads: PosInt = 4  # one head per draft depth


class StaticTreeFamily(learned.Family):
  """A head-per-depth family over static trees; subclasses set `drafter_cls` (its pytree, a
  `StaticTreeDrafter`), the network (`module`, `config_cls`), `options_cls` (a
  `StaticTreeOptions`) and `depth_logits`."""

  drafter_cls: type
  options_cls = StaticTreeOptions

  def make_config(self, target_cfg, *, draft_vocab_size: int, num_features: int,
                  options: StaticTreeOptions | None = None):
    del draft_vocab_size, num_features  # the heads read one feature and the target's head
    return self.config_cls(target_cfg.hidden_size, (options or self.options_cls()).num_heads)

  def check_training(self, cfg) -> None:
    deepest, heads = max(cfg.train_steps, cfg.eval_depth), cfg.family.num_heads
    if deepest > heads:
      raise ValueError(f"{self.name} has {heads} heads (num_heads): train_steps and "
                       f"eval_depth must not exceed it, got {deepest}")

  def assemble(self, net, params, d2t, target, hidden_layers, *, choices=None,
               recent_tokens: int = 0, children=learned.DEFAULT_CHILDREN,
               draft_temperature=None):
    """Tree options: `choices` (a name in TREES, rank paths, or their JSON text; default
    tree15), `recent_tokens` (`LearnedDrafter.recent_vocab`), `children` and
    `draft_temperature` (`specjax.children`: sampled children replace ranks by draws, a
    parent's i-th child its i-th). The heads draft through the target's LM head restricted to
    the draft vocabulary."""
    paths = parse_choices(choices)
    template = trees.TreeTemplate.from_paths(DEFAULT_CHOICES if paths is None else paths)
    check_template(template, net.num_heads, d2t.shape[0])
    recent_tokens = learned.check_recent_tokens(recent_tokens, target.config)
    head = self.draft_head(net, target, d2t)
    return self.drafter_cls(params=params, d2t=d2t, head=head, recent_tokens=recent_tokens,
                            built_for=TargetFacts.of(target.config),
                            children=learned.check_children(children, draft_temperature), net=net,
                            template=template, hidden_layers=hidden_layers)

  def draft_head(self, net, target, d2t) -> jax.Array | None:
    """The drafter's `head`: the target's LM head over the draft vocabulary [E, Vd]."""
    return learned.restricted_head(target.config, target.params, d2t).astype(net.dtype)

  def tree_options(self, spec: str) -> dict:
    """'d': a chain of d nodes; a name in TREES: that tree."""
    if spec.isdigit():
      return dict(choices=json.dumps([[0] * i for i in range(1, int(spec) + 1)]))
    if spec in TREES:
      return dict(choices=spec)
    raise ValueError(f"tree {spec!r} does not fit {self.name}: use a chain length or one of "
                     f"{sorted(TREES)}")

  def tune_grid(self) -> list[dict]:
    return [dict(choices=name) for name in TREES]
