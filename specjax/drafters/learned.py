"""What the learned drafters (Medusa, Hydra, EAGLE, EAGLE-3) share.

  * `DraftVocab`: a reduced draft vocabulary (EAGLE-3's d2t), the target ids the drafter can
    propose, most frequent first when built from counts. Drafting over Vd << V tokens is what makes
    a draft head cheap next to a small target, whose own LM head is a third of its step.
  * `LearnedDrafter`: the base of the four families' pytrees: trained `params` (an nnx.State),
    the draft vocabulary, and the frozen target LM head restricted to it (gathered once at load).
  * The drafter network convention: an NNX module per family, used through `nnx.split` /
    `nnx.merge` (the decoder's idiom), with a hashable config that is a static jit argument.
  * Target pieces the heads read: the input embedding, the (restricted) unembedding, and the
    features of chosen hidden layers concatenated along E.
  * `Family`: everything family-specific that the generic trainer (specjax.train.drafter), the
    loader (specjax.drafters.io), the tree tuner and the drafter comparison need, on one object
    defined in the family's own file. Nothing outside a family's file branches on its name.
  * `FamilyOptions`: the base of each family's training options (its `Family.options_cls`, the
    trainer's `family` group), with the options several families share (`TapOptions`,
    `FeatureNoiseOptions`), so a new option is a field in its family's file only.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax import checks, sharding
from specjax.children import TOP_K, Children
from specjax.children import check as check_children  # noqa: F401 (the families' option check)
from specjax.config_utils import NonNegFloat, NonNegInt, config
from specjax.drafters.base import TargetFacts
from specjax.models import decoder, layers
from specjax.models.config import ModelConfig

# ------------------------------------------------------------------------------------------------
# Draft vocabulary


def drafter_dtype(target_cfg: ModelConfig) -> str:
  """The dtype a learned drafter is loaded at and computes in: the target's compute dtype.

  A target stored in bfloat16 that computes in float32 (the embedded default) gets a float32
  drafter. Kept in bfloat16, such a drafter computes in bfloat16, which a CPU has no arithmetic
  for: XLA widens every op, and each draft level's KV-cache write converts the whole cache to
  float32 and back. Where the target computes in bfloat16 (accelerators) the drafter does too.
  """
  return target_cfg.compute_dtype


def draft_vocab_from_counts(counts: np.ndarray, size: int) -> np.ndarray:
  """int32[size]: the `size` most frequent target ids (ties: lower id first), most frequent first.

  Sorting by frequency (not by id as EAGLE-3 does) changes nothing in the maths and lets a
  shorter draft vocabulary be read off as a prefix.
  """
  counts = np.asarray(counts)
  if not 1 <= size <= counts.size:
    raise ValueError(f"draft vocabulary size must be in [1, {counts.size}], got {size}")
  order = np.lexsort((np.arange(counts.size), -counts))  # by count desc, then id asc
  return order[:size].astype(np.int32)


def vocab_coverage(counts: np.ndarray, d2t: np.ndarray) -> float:
  """Fraction of the counted tokens that the draft vocabulary can propose."""
  counts = np.asarray(counts, np.float64)
  return float(counts[np.asarray(d2t)].sum() / max(counts.sum(), 1.0))


# ------------------------------------------------------------------------------------------------
# Target pieces


def target_embedding(cfg: ModelConfig, params: nnx.State) -> jax.Array:
  """[V, E] the target's input embedding table (frozen: drafters read it, never train it), as
  the checkpoint stores it; `input_embeddings` is what the target's first layer reads."""
  return nnx.merge(decoder.graphdef(cfg), params).embed_tokens.embedding[...]


def input_embeddings(cfg: ModelConfig, params: nnx.State) -> jax.Array:
  """[V, E] the embeddings as the target's first layer reads them: the table itself, or for
  Gemma the table times sqrt(E) in the compute dtype (a scaled copy), so that drafters fed
  target embeddings see the target's."""
  table = target_embedding(cfg, params)
  if not cfg.embed_scale:
    return table
  return layers.scale_embeddings(cfg, table.astype(cfg.compute_jnp_dtype))


def restricted_head(cfg: ModelConfig, params: nnx.State, d2t: jax.Array) -> jax.Array:
  """[E, Vd] the target's LM head over the draft vocabulary (columns d2t)."""
  return jnp.take(decoder.unembedding(cfg, params), jnp.asarray(d2t), axis=1)


def head_columns(cfg: ModelConfig, params: nnx.State, tokens: jax.Array) -> jax.Array:
  """[..., E] the target's LM head columns of target ids `tokens` (any shape), gathered per call:
  for a few ids per round (the draft vocabulary's columns are gathered once, `restricted_head`)."""
  if cfg.tie_word_embeddings:  # the stored rows: Gemma's embedding scale is not the head's
    return jnp.take(target_embedding(cfg, params), tokens, axis=0)
  kernel = nnx.merge(decoder.graphdef(cfg), params).lm_head.kernel[...]  # [E, V]
  return jnp.moveaxis(jnp.take(kernel, tokens, axis=1), 0, -1)


def embed(cfg: ModelConfig, params: nnx.State, tokens: jax.Array) -> jax.Array:
  """[..., E] target embeddings of target token ids, as the target's first layer reads them
  (rows of `input_embeddings`, gathered before Gemma's scale rather than scaling the table)."""
  rows = jnp.take(target_embedding(cfg, params), tokens, axis=0)
  if not cfg.embed_scale:
    return rows
  return layers.scale_embeddings(cfg, rows.astype(cfg.compute_jnp_dtype))


def concat_features(hidden: jax.Array) -> jax.Array:
  """[len(hidden_layers), B, T, E] -> [B, T, len * E]: low layer first, as EAGLE-3 concatenates."""
  return jnp.concatenate(list(hidden), axis=-1)


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x: [B, T, ...], index: int32[B] -> [B, ...] the row index[b] of each batch entry."""
  return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


# ------------------------------------------------------------------------------------------------
# Networks


@functools.cache
def graphdef(module_cls, net_cfg) -> nnx.GraphDef:
  """The static structure of `module_cls(net_cfg)`, computed once without allocating params."""
  gdef, _ = nnx.split(nnx.eval_shape(lambda: module_cls(net_cfg, nnx.Rngs(0))))
  return gdef


def init_params(module_cls, net_cfg, seed: int) -> nnx.State:
  _, state = nnx.split(module_cls(net_cfg, nnx.Rngs(seed)))
  return state


def abstract_params(module_cls, net_cfg) -> nnx.State:
  _, state = nnx.split(nnx.eval_shape(lambda: module_cls(net_cfg, nnx.Rngs(0))))
  return state


def merge(module_cls, net_cfg, params: nnx.State):
  return nnx.merge(graphdef(module_cls, net_cfg), params)


@struct.dataclass
class RecentVocab:
  """A round's extra draft ids (`LearnedDrafter.recent_vocab`): draft id Vd + j is `ids[:, j]`."""

  ids: jax.Array  # int32[B, R] target ids
  cols: jax.Array  # [B, R, E] their target LM head columns
  live: jax.Array  # bool[B, R] false: already in the draft vocabulary, a repeat, or before the text


def check_recent_tokens(recent_tokens: int, target_cfg: ModelConfig | None = None) -> int:
  """An int >= 0 (and, given the target's config, at most its context: the history is no
  longer)."""
  if not checks.is_int(recent_tokens):
    raise ValueError(f"recent_tokens must be an int >= 0, got {recent_tokens!r} "
                     f"({type(recent_tokens).__name__})")
  if recent_tokens < 0:
    raise ValueError(f"recent_tokens must be >= 0, got {recent_tokens}")
  if target_cfg is not None and recent_tokens > target_cfg.max_position_embeddings:
    raise ValueError(f"recent_tokens must be in [0, {target_cfg.max_position_embeddings}] (the "
                     f"target's context), got {recent_tokens}")
  return int(recent_tokens)


@struct.dataclass
class LearnedDrafter:
  """Fields every learned drafter has; the family's pytree subclasses it.

  params: the trained network (an nnx.State); d2t: int32[Vd] target id of each draft id;
  head: [E, Vd] the frozen target LM head restricted to d2t (families with their own head keep
  it in params and leave this None); recent_tokens: how many of the history's last tokens join
  the draft vocabulary each round (`recent_vocab`; 0: none); built_for: the target it was
  assembled for (`base.TargetFacts`), which `generate` checks.
  """

  params: nnx.State
  d2t: jax.Array
  head: jax.Array | None
  recent_tokens: int = struct.field(pytree_node=False, default=0)
  built_for: TargetFacts | None = struct.field(pytree_node=False, default=None)
  # How a parent's children are picked at temperatures > 0 (`specjax.children`): top-k, or
  # draws from q; at temperature 0 always the top-k.
  children: Children = struct.field(pytree_node=False, default=TOP_K)

  @property
  def head_dtype(self):
    """The drafter's compute dtype: its params'."""
    return jax.tree.leaves(self.params)[0].dtype

  def recent_vocab(self, target, ctx) -> RecentVocab | None:
    """The round's extra draft ids: the last `recent_tokens` tokens of each row's history
    (`ctx`, a DraftContext) that the draft vocabulary lacks, each once (its most recent copy).

    A reduced vocabulary built from corpus counts misses the identifiers of a prompt, and a
    target that loops on such a token would otherwise never be drafted for. The extra ids are
    scored by the target's own LM head columns (`with_recent`), which needs no retraining: where
    the drafter's head is the target's (Medusa, Hydra, EAGLE), exactly the logits a
    full-vocabulary head would give; EAGLE-3, whose head is its own (initialised from the
    target's), scores them with the target's columns after its final norm. Losslessness does
    not depend on those scores, only speed.
    """
    if not self.recent_tokens:
      return None
    n = self.recent_tokens
    idx = ctx.hist_len[:, None] - n + jnp.arange(n)[None, :]  # [B, n], oldest first
    ids = jnp.take_along_axis(ctx.history, jnp.clip(idx, 0, ctx.history.shape[1] - 1), 1)
    in_vocab = jnp.zeros((target.config.vocab_size,), bool).at[self.d2t].set(True)
    later_copy = jnp.any((ids[:, :, None] == ids[:, None, :]) & jnp.triu(
        jnp.ones((n, n), bool), 1)[None], axis=-1)
    live = (idx >= 0) & ~in_vocab[ids] & ~later_copy
    cols = head_columns(target.config, target.params, ids).astype(self.head_dtype)
    return RecentVocab(ids, cols, live)

  def q_ids(self, batch: int, recent: RecentVocab | None = None) -> jax.Array:
    """int32[B, Vd (+ R)]: the target id of each entry of a draft distribution (d2t, then the
    round's extra ids; an extra that is not live has q = 0 wherever it points)."""
    ids = jnp.broadcast_to(self.d2t, (batch,) + self.d2t.shape)
    return ids if recent is None else jnp.concatenate([ids, recent.ids.astype(ids.dtype)], 1)

  def with_targets(self, tree, recent: RecentVocab | None = None):
    """`tree` in draft ids -> the same tree in target ids, its draft rows mapped by `q_ids`."""
    tree = tree.replace(tokens=self.to_target_ids(tree.tokens, recent))
    if tree.draft is None:
      return tree
    return tree.replace(draft=tree.draft.replace(ids=self.q_ids(tree.batch_size, recent)))

  def to_target_ids(self, draft_ids: jax.Array, recent: RecentVocab | None = None) -> jax.Array:
    """int32[B, ...] target ids of draft ids; with `recent`, ids >= Vd are the round's extras."""
    if recent is None:
      return jnp.take(self.d2t, draft_ids, axis=0)
    vd = self.d2t.shape[0]
    fixed = jnp.take(self.d2t, jnp.minimum(draft_ids, vd - 1), axis=0)
    flat = draft_ids.reshape(draft_ids.shape[0], -1)
    extra = jnp.take_along_axis(recent.ids, jnp.clip(flat - vd, 0, recent.ids.shape[1] - 1), 1)
    return jnp.where(draft_ids < vd, fixed, extra.reshape(draft_ids.shape))


def with_recent(logits: jax.Array, head_input: jax.Array, recent: RecentVocab | None
                ) -> jax.Array:
  """[B, ..., Vd (+ R)]: draft logits followed by the round's extra ids scored by the target's
  head columns on `head_input` [B, ..., E] (what the draft head reads); -inf where not live."""
  if recent is None:
    return logits
  extra = jnp.einsum("B...E,BRE->B...R", head_input, recent.cols,
                     preferred_element_type=jnp.float32)
  live = recent.live.reshape(recent.live.shape[:1] + (1,) * (head_input.ndim - 2)
                             + recent.live.shape[1:])
  return jnp.concatenate([logits, jnp.where(live, extra, -jnp.inf)], axis=-1)


def map_leaf(params: nnx.State, path: str, fn: Callable[[jax.Array], jax.Array]) -> nnx.State:
  """`params` with the leaf at `path` (e.g. "lm_head/kernel") replaced by fn(leaf)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: fn(x) if sharding.path_str(p) == path else x, params)


def draft_logprobs(logits: jax.Array) -> jax.Array:
  """float32 log-softmax over the draft vocabulary: the scores trees are built from."""
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def grown_tree_options(spec: str, family: str, example: str) -> dict[str, int]:
  """Tree options of a grown tree (EAGLE-2's, or one from a block's marginals) from a short
  spec: 'd' is a chain of d nodes, 'd x k x n' (e.g. `example`) depth d, top_k k, n nodes."""
  if spec.isdigit():
    return dict(depth=int(spec), top_k=1, total_tokens=int(spec))
  parts = spec.split("x")
  if len(parts) == 3 and all(p.isdigit() for p in parts):
    return dict(zip(("depth", "top_k", "total_tokens"), map(int, parts)))
  raise ValueError(f"tree {spec!r} does not fit {family}: use a chain length or "
                   f"depth x top_k x total_tokens (e.g. {example})")


# The children learned drafters pick at temperatures > 0 unless a tree option says otherwise
# (`specjax.children`): i.i.d. draws from q. A sampled child is accepted with probability
# min(1, r(x) / q(x)) instead of the residual's mass at a top-k token. Chosen by measurement
# (`python -m experiments.reproduce sampling`, T = 1 on HumanEval, 2 CPU cores): on the shipped
# chains, where both modes make the same draw and reach the same tau, i.i.d. children ran 7-27%
# faster than draws without replacement (a categorical draw against Gumbel noise and a top-k
# over the vocabulary, and a plainer verification), and on Medusa's tree they reached a higher
# tau too; "wor" remains an option (siblings that never repeat a token), as does "top_k". At
# temperature 0 every mode drafts its top-k.
DEFAULT_CHILDREN = "iid"


# ------------------------------------------------------------------------------------------------
# Training options


@config
class FamilyOptions:
  """A family's training options: the base of its `Family.options_cls`, the trainer's `family`
  group (`--set family.<option>=...`). A family without options uses it as it is.

  The generic trainer reads an option only through the properties below, which a family's
  options override, so that it names none of them: a new option is a field in the family's file.
  """

  @property
  def taps(self) -> tuple[int, ...] | None:
    """The target hidden states the run taps; None: the family's `default_taps`."""
    return None

  @property
  def noise(self) -> float:
    """Amplitude a of the uniform noise in [-a, a] on the features the drafter reads (0: none)."""
    return 0.0

  @property
  def aux_weight(self) -> float:
    """Weight of the family's auxiliary loss (`Family.depth_logits`' aux)."""
    return 1.0

  @classmethod
  def why_no_field(cls, name: str) -> str:
    """What a refusal of the unknown option `name` adds (`config_utils`): whose options these
    are and which families read `name`, e.g. after a change of method."""
    from specjax.drafters import registry
    owners = [m for m in registry.families() if registry.family(m).options_cls is cls]
    readers = [m for m in registry.families()
               if name in option_names(registry.family(m).options_cls)]
    return (f"{name} is not an option of {', '.join(owners) or cls.__name__} (its options: "
            f"{option_names(cls)}); {name} is read by {readers}")


def option_names(cls: type) -> list[str]:
  """The fields of a family's options class, in order."""
  return [f.name for f in dataclasses.fields(cls)]


@config
class TapOptions(FamilyOptions):
  """The taps option, for families that fuse several target hidden states."""

  # Taps: target hidden states fused (0 = embeddings, L = final normed state; default: the
  # family's `default_taps`).
  target_layers: tuple[NonNegInt, ...] | None = None

  def __post_init__(self):
    taps = self.target_layers
    if taps is not None and (not taps or len(set(taps)) != len(taps)):
      raise ValueError(f"target_layers must be distinct layer ids, got {taps}")

  @property
  def taps(self) -> tuple[int, ...] | None:
    return self.target_layers


@config
class FeatureNoiseOptions(FamilyOptions):
  """The feature augmentation option, for families that roll forward on their own features."""

  # Feature augmentation: uniform noise in [-a, a] on the target features the drafter reads (not
  # on what a regression aims at), so the features it rolls forward on at inference, its own and
  # never exact, are not out of distribution. 0 = none.
  feature_noise: NonNegFloat = 0.0

  @property
  def noise(self) -> float:
    return self.feature_noise


# ------------------------------------------------------------------------------------------------
# The family protocol


@dataclasses.dataclass(frozen=True)
class DepthInputs:
  """What a family's training view (`Family.depth_logits`) reads for a batch of token rows."""

  feats: jax.Array  # [B, T, F] target features of the taps as the drafter reads them (noised
  #                   in training when the run asks for feature noise)
  clean: jax.Array  # [B, T, F] the same features without training noise (regression targets)
  tokens: jax.Array  # int32[B, T]
  emb: jax.Array  # [V, E] the target's input embedding (frozen)
  head: jax.Array | None  # [E, Vd] the target's LM head over the draft vocabulary, for families
  #                         that draft through it (`Family.uses_target_head`), else None
  starts: jax.Array | None = None  # int32[B, N] the starts t the view is asked for (training
  #                         on a subset, `Family.starts`); None: every t of the row


class Family(abc.ABC):
  """A learned drafter family. Subclass it in the family's file and register one instance with
  `specjax.drafters.io.register_family`; the trainer, loader, tuner and comparison then serve it.

  Attributes:
    name, description: registry name and one line for listings.
    module: the family's network, an nnx.Module built as `module(net_cfg, rngs)`.
    config_cls: its network config, a frozen dataclass with `dtype` and `with_dtype(dtype)`
      (saved in the drafter folder's config.json as "net").
    uses_target_head: drafts through the target's frozen LM head restricted to the draft
      vocabulary (`restricted_head`), which training and loading then provide as `head`.
    options_cls: its training options, a `@config` dataclass deriving from `FamilyOptions`
      (fields, ranges, defaults and comments): the training config's `family` group, so the
      trainer refuses an option the family does not have and `--help` lists the family's own.
    free_fields: network config fields no parameter's shape or meaning depends on, which a
      run may change from the drafter it starts from (`init_from`), e.g. DFlash's block size.
  """

  name: str
  description: str = ""
  module: type
  config_cls: type
  uses_target_head: bool = True
  options_cls: type = FamilyOptions
  free_fields: tuple[str, ...] = ()

  # -- network -------------------------------------------------------------------------------

  def default_taps(self, target_cfg: ModelConfig) -> tuple[int, ...]:
    """Target hidden-state indices read when training names none (0 = embeddings, i = output
    of layer i, L = final normed state): by default the final state, the LM head's input."""
    return (target_cfg.num_layers,)

  def taps(self, options: FamilyOptions, target_cfg: ModelConfig) -> tuple[int, ...]:
    """The target hidden states a run with `options` reads: the ones it names (`options.taps`,
    ascending, each checked against the target), else `default_taps`."""
    if options.taps is None:
      return self.default_taps(target_cfg)
    n = target_cfg.num_layers
    bad = [i for i in options.taps if not 0 <= i <= n]
    if bad:
      raise ValueError(f"target_layers {bad} are outside [0, {n}] (the target has {n} layers)")
    return tuple(sorted(options.taps))

  @abc.abstractmethod
  def make_config(self, target_cfg: ModelConfig, *, draft_vocab_size: int, num_features: int,
                  options: FamilyOptions | None = None):
    """The network config for a target; `options`: the family's training options (an
    `options_cls`; None: its defaults, as for an untrained drafter)."""

  def shrink_vocab(self, net, params: nnx.State, size: int) -> tuple[Any, nnx.State]:
    """(net, params) drafting over the first `size` draft ids (`load_drafter(draft_vocab=)`).
    A family that drafts through the target's head keeps its network (the head is restricted
    to the shorter d2t when assembled); a config's `draft_vocab_size` follows. A family with
    its own head over the draft vocabulary also keeps that head's first `size` columns."""
    if getattr(net, "draft_vocab_size", 0):
      net = dataclasses.replace(net, draft_vocab_size=size)
    return net, params

  def init_params(self, net, target, d2t, seed: int) -> nnx.State:
    """Training's starting point (default: the module's own initialisation)."""
    del target, d2t
    return init_params(self.module, net, seed)

  # -- training ------------------------------------------------------------------------------

  def check_training(self, cfg) -> None:  # noqa: B027 (optional hook: nothing to check)
    """Raises ValueError for a training config (`DrafterTrainConfig`, its options in
    `cfg.family`) this family cannot run: what relates its options to the run's other fields."""

  def starts(self, cfg, key: jax.Array, batch: int, length: int) -> jax.Array | None:
    """int32[batch, N]: the starts a training step scores (`DepthInputs.starts`), drawn from
    `key`; None (the default): every start of the row. A family whose view costs the same per
    start (one block per start, DFlash) trains on a random subset."""
    del cfg, key, batch, length
    return None

  def frozen_leaves(self, cfg) -> Callable[[Any], Any] | None:
    """`params -> bool per leaf`: the leaves training keeps fixed under `cfg`, or None."""
    del cfg
    return None

  @abc.abstractmethod
  def depth_logits(self, net, params, x: DepthInputs, num_steps: int, *, train: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
    """The training view: (logits float32[num_steps, B, T, Vd], aux loss scalar).

    logits[s, b, t] is the family's draft distribution for the token at t + s + 2, made from
    the state a depth-(s + 1) tree node would have at inference after position t. When
    `x.starts` is given (a family's own `starts`), the third axis runs over those starts
    instead: logits[s, b, n] for the token at starts[b, n] + s + 2. aux is the
    family's auxiliary loss (weighted by its options' `aux_weight`); `train` is False for
    evaluation, where only the logits are used."""

  # -- inference -----------------------------------------------------------------------------

  @abc.abstractmethod
  def assemble(self, net, params: nnx.State, d2t: jax.Array, target, hidden_layers,
               **tree_options):
    """The drafter pytree from loaded (or fresh) params; tree_options shape its tree."""

  @abc.abstractmethod
  def tree_options(self, spec: str) -> dict[str, Any]:
    """Tree options from a short spec (`experiments.compare_drafters --trees`); every family
    reads a plain integer d as a chain of d nodes."""

  @abc.abstractmethod
  def tune_grid(self) -> list[dict[str, Any]]:
    """The tree option sets `experiments.tune_tree` tries by default."""
