"""The drafter protocol: what every drafter file fills in.

A drafter is a pytree (its params are leaves; its configuration is static) with three pure
functions, all called inside the jitted decoding loop:

  init(target, prefill)            -> state            after the prompt's prefill
  draft(target, state, ctx)        -> (tree, state, cache)   propose a fixed-shape tree
  update(target, state, result)    -> state            learn from the verification

`target` is a `TargetView` (the target's static config and its params, which drafters such as
layer-skip read without copying). `ctx` and `result` carry what drafters commonly need: the token
history (prompt + emitted, the last one being `pending`), the target's KV cache, the target's
logits and requested hidden states on the verified block, and the acceptance.

Static attributes every drafter defines:
  num_nodes:     N, the fixed tree size;
  hidden_layers: target hidden-state indices the drafter reads in `update` (0 = embeddings,
                 i = output of layer i, L = final normed state).
Whether node tokens were sampled is said by each tree: `Tree.draft`, the distributions they
were drawn from (one row per expanded parent, `trees.DraftDist`), or None when the children were
chosen deterministically (recursive rejection needs only the target's p). Verification reads
only that, so one drafter may draft either way (greedy or sampled) round by round.

Optional (a drafter without them still runs):
  children:      how it picks children at temperatures > 0 (`specjax.children.Children`;
                 absent: top-k, deterministic). A rule that needs i.i.d. children (SpecTr's
                 k-sequential selection) is refused for a drafter whose mode is another.
  built_for:     the `TargetFacts` of the target it was built for; `generate` refuses another
                 target. Every shipped drafter records it at build time: a drafter sized for one
                 target would otherwise run on another and fail deep inside the trace (or not at
                 all, proposing ids of another vocabulary).
  verify_sizes:  node counts below N at which a round's tree may also be verified. Each round the
                 loop verifies the tree's first n nodes, n the smallest of these sizes and N that
                 holds every live row's last valid node (`verify_sizes_of`): a drafter that
                 proposes fewer nodes when it is unsure (an adaptive draft length) then pays for
                 a smaller target call. Nodes past n are invalid in every row, so the output is the
                 same as verifying all N. `update` sees the tree, logits and hidden states of the
                 n verified nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
from flax import nnx, struct

from specjax import checks
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingConfig
from specjax.trees import Tree
from specjax.verify import Acceptance


@struct.dataclass
class TargetView:
  config: ModelConfig = struct.field(pytree_node=False)
  sampling: SamplingConfig  # a pytree: its mode is static, temperature and top-p traced
  params: nnx.State


@struct.dataclass
class Prefill:
  """The prompt pass: what `init` sees."""

  prompt: jax.Array  # int32[B, P] the right-padded prompts (prompt_len = hist_len - 1)
  history: jax.Array  # int32[B, W] prompt tokens then emitted ones; slots >= hist_len are junk
  hist_len: jax.Array  # int32[B] tokens in `history` (prompt + the first sampled token)
  logits: jax.Array  # float32[B, V] the target's logits at the last prompt token
  hidden: jax.Array | None  # [len(hidden_layers), B, P, E] hidden states of the prompt, or None
  cache: KVCache  # the target cache holding the prompt


@struct.dataclass
class DraftContext:
  """The start of a round: `history[b, hist_len[b] - 1]` is `pending`, not yet in the cache."""

  history: jax.Array  # int32[B, W]
  hist_len: jax.Array  # int32[B]
  pending: jax.Array  # int32[B]
  cache: KVCache  # the target cache (committed prefix: hist_len - 1 tokens)
  rng: jax.Array


@struct.dataclass
class RoundResult:
  """The end of a round, after acceptance and before the cache commit is visible to drafters."""

  tree: Tree
  acceptance: Acceptance
  block_tokens: jax.Array  # int32[B, N+1] [pending | tree tokens]
  logits: jax.Array  # float32[B, N+1, V] target logits on the verified block
  hidden: jax.Array | None  # [len(hidden_layers), B, N+1, E] or None
  live: jax.Array  # bool[B] rows that were still generating this round
  history: jax.Array  # int32[B, W] history after appending the emitted tokens
  hist_len: jax.Array  # int32[B]


class Drafter(Protocol):
  num_nodes: int
  hidden_layers: tuple[int, ...]

  def init(self, target: TargetView, prefill: Prefill) -> Any:
    ...

  def draft(self, target: TargetView, state: Any, ctx: DraftContext
            ) -> tuple[Tree, Any, KVCache]:
    ...

  def update(self, target: TargetView, state: Any, result: RoundResult) -> Any:
    ...


@dataclasses.dataclass(frozen=True)
class TargetFacts:
  """What of a target a drafter's shapes depend on (hashable: a static field of its pytree)."""

  vocab_size: int
  hidden_size: int
  num_layers: int

  @classmethod
  def of(cls, config: ModelConfig) -> TargetFacts:
    return cls(config.vocab_size, config.hidden_size, config.num_layers)

  def check(self, config: ModelConfig) -> None:
    """Raises ValueError naming the first fact in which `config` differs."""
    for f in dataclasses.fields(self):
      built, have = getattr(self, f.name), getattr(config, f.name)
      if built != have:
        raise ValueError(f"this drafter was built for another target ({f.name} {built}, this "
                         f"target has {have}): build one for this target with "
                         "specjax.drafters.build(name, target)")


_PROTOCOL = ("num_nodes", "hidden_layers", "init", "draft", "update")


def check_drafter(drafter: Any, config: ModelConfig) -> None:
  """Raises ValueError unless `drafter` follows the protocol and fits a target of `config`."""
  if isinstance(drafter, str):
    raise ValueError(f"drafter must be a drafter object, not the name {drafter!r}: pass "
                     f"specjax.drafters.build({drafter!r}, target)")
  missing = [a for a in _PROTOCOL if not hasattr(drafter, a)]
  if missing:
    raise ValueError(f"drafter must follow the Drafter protocol ({', '.join(_PROTOCOL)}): "
                     f"{type(drafter).__name__} has no {', '.join(missing)}")
  built_for = getattr(drafter, "built_for", None)
  if built_for is not None:
    built_for.check(config)
  checks.integer("drafter.num_nodes", drafter.num_nodes, lo=0)
  verify_sizes_of(drafter)
  for i in drafter.hidden_layers:
    if not checks.is_int(i) or not 0 <= i <= config.num_layers:
      raise ValueError(f"drafter.hidden_layers holds {i!r}: hidden-state indices of this target "
                       f"are ints in [0, {config.num_layers}]")


def verify_sizes_of(drafter: Any) -> tuple[int, ...]:
  """The node counts a round of `drafter` may be verified at, ascending: its optional
  `verify_sizes` and N. ValueError for a size that is not an int in [0, N]."""
  n = drafter.num_nodes
  sizes = getattr(drafter, "verify_sizes", ())
  for size in sizes:
    if not checks.is_int(size) or not 0 <= size <= n:
      raise ValueError(f"drafter.verify_sizes holds {size!r}: sizes are ints in [0, {n}] (the "
                       "drafter's num_nodes)")
  return tuple(sorted({int(size) for size in sizes} | {n}))


class Stateless:
  """Mixin for drafters that keep no state between rounds (model-free or purely functional)."""

  def init(self, target: TargetView, prefill: Prefill) -> tuple:
    return ()

  def update(self, target: TargetView, state: Any, result: RoundResult) -> Any:
    return state


@struct.dataclass
class NoDrafter(Stateless):
  """Autoregressive decoding: the empty tree. The baseline shares every line of the loop."""

  num_nodes: int = struct.field(pytree_node=False, default=0)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())

  def draft(self, target, state, ctx):
    return Tree.empty(ctx.pending.shape[0]), state, ctx.cache
