"""How a learned drafter picks a parent's children: its top-k, or draws from its distribution q.

Three modes (`Children.mode`), the same for every tree builder (static templates, EAGLE-2's
dynamic tree, a block drafter's chain and best-first tree):

  * "top_k": the k most likely draft ids, deterministically. Verification treats each child as
    drawn from a one-hot q (recursive rejection over deterministic children): a child x is
    accepted with the residual's mass at x, which is small where the target spreads its mass.
  * "iid": k independent draws from q (SpecInfer's multi-draft). A child is accepted with
    probability min(1, r(x) / q(x)), so a drafter whose q is close to p is accepted with
    probability 1 - TV(p, q) whatever the temperature.
  * "wor": k draws without replacement (the Gumbel-top-k trick: the top k of log q + Gumbel
    noise are a sample without replacement, in order; Recursive Speculative Decoding, Jeon et al.
    2024). Sibling i was drawn from q with its earlier siblings' tokens removed, renormalised;
    verification is told exactly that (`trees.DraftDist.without_replacement`). Siblings never
    repeat a token.

At temperature 0 every mode drafts its top-k: the round is greedy, and its output and accepted
lengths are those of "top_k" bit for bit.

q is the drafter's distribution at the run's temperature by default (`Children.temperature`
None), or at a temperature of its own: losslessness depends only on drawing from the q that
verification is told about, never on which q that is.

Which children a grown tree keeps. EAGLE-2 ranks a node by the cumulative draft log-probability
of its path and keeps the best. With sampled children that score must not be the q of the node's
*own* sampled token: keeping a node because its token happened to be likely biases the token
that verification then treats as a draw from q (a node kept only when its token is the likelier
one of two is always that token, whatever the target says). A sampled child is instead ranked by
the score of its *slot*, `Picked.scores`: its parent's score plus the log of the i-th largest q
at the parent for the parent's i-th child. It depends on the parent's path and q, never on the
child's own token or on anything drawn below it, and it falls along every path and down every
sibling list, so the kept set is a prefix-closed tree whose kept siblings are the first ones
drawn. That is exactly the information recursive rejection's induction may condition on, so the
tree is lossless in both sampled modes; the shape EAGLE-2 would give its deterministic children
is given to the sampled ones. (A pruned tree's later siblings do depend on what the earlier ones
drew below them, which recursive rejection allows and K-SEQ does not: `trees.grown_counts_fixed`.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import checks
from specjax.sampling import SamplingConfig

MODES = ("top_k", "iid", "wor")
SAMPLED_MODES = ("iid", "wor")


@dataclasses.dataclass(frozen=True)
class Children:
  """A drafter's choice of children (a static option: hashable).

  mode: "top_k", "iid" or "wor" (module docstring); temperature: q's temperature for the
  sampled modes, None for the run's (a float > 0 otherwise)."""

  mode: str = "top_k"
  temperature: float | None = None

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"children must be one of {list(MODES)} (top_k: deterministic; iid: "
                       f"independent draws from q; wor: draws without replacement), got "
                       f"{self.mode!r}")
    if self.temperature is not None:
      if self.mode == "top_k":
        raise ValueError("draft_temperature applies to sampled children (children iid or "
                         "wor), not to top_k")
      t = checks.real("draft_temperature", self.temperature)
      if not 0.0 < t < float("inf"):
        raise ValueError(f"draft_temperature must be a float > 0 (None: the run's "
                         f"temperature), got {self.temperature!r}")
      object.__setattr__(self, "temperature", t)

  @property
  def sampled(self) -> bool:
    """Whether children are drawn from q at temperatures > 0."""
    return self.mode in SAMPLED_MODES

  def used(self, sampling: SamplingConfig) -> str:
    """The mode a run at `sampling` drafts with: "top_k" when greedy, else `mode`."""
    return "top_k" if sampling.greedy else self.mode

  def q_temperature(self, sampling: SamplingConfig):
    """q's temperature in a run at `sampling` (a traced value when it is the run's)."""
    return sampling.temperature if self.temperature is None else self.temperature


TOP_K = Children()
SAMPLED_CHAIN = Children("iid")  # drafters that sample a chain from q (a draft LM)


def check(mode, temperature=None) -> Children:
  """A `Children` from a drafter's tree options (`children=`, `draft_temperature=`)."""
  if isinstance(mode, Children):
    return mode
  if not isinstance(mode, str):
    raise ValueError(f"children must be one of {list(MODES)}, got {mode!r}")
  return Children(mode, temperature)


@struct.dataclass
class Picked:
  """The children of G parents, k each."""

  tokens: jax.Array  # int32[B, G, k]  draft ids, in the order drawn (top-k: best first)
  scores: jax.Array  # float32[B, G, k]  their slots' log-scores (top-k: their log-probabilities)
  ok: jax.Array  # bool[B, G, k]  the slot holds a token (wor: q's support was not exhausted)
  q: jax.Array | None  # float32[B, G, V] the distributions drawn from; None for top-k


def pick(children: Children, sampling: SamplingConfig, key: jax.Array, logp: jax.Array,
         k: int) -> Picked:
  """k children for each of G parents from their draft log-probabilities logp: [B, G, V].

  Deterministic (top-k of logp, all slots ok, q None) for mode "top_k" and for a greedy run;
  otherwise k draws from q = softmax(logp / temperature) as `children.mode` says, with slot
  scores the k largest log q (module docstring)."""
  logp = logp.astype(jnp.float32)
  if children.used(sampling) == "top_k":
    scores, tokens = jax.lax.top_k(logp, k)
    return Picked(tokens.astype(jnp.int32), scores, jnp.ones(tokens.shape, bool), None)
  logq = jax.nn.log_softmax(logp / children.q_temperature(sampling), axis=-1)
  q = jnp.exp(logq)
  scores = jax.lax.top_k(logq, k)[0]
  if children.mode == "wor":
    perturbed = logq + jax.random.gumbel(key, logq.shape, jnp.float32)
    drawn, tokens = jax.lax.top_k(perturbed, k)
    ok = drawn > -jnp.inf  # past q's support the "draw" is an id of q = 0: no node
  else:
    b, g, v = logq.shape
    tokens = jax.random.categorical(key, logq[:, :, None, :], axis=-1, shape=(b, g, k))
    ok = jnp.ones(tokens.shape, bool)
  return Picked(tokens.astype(jnp.int32), jnp.where(ok, scores, -jnp.inf), ok, q)
