"""What a measurement of one method records (`MethodRecord`), the figures derived from a run's
records against its autoregressive one (`add_speedups`, `finish`), and the JSON form both are
stored in.

A record is typed so that a table reads `r.tau`, not `r["tau"]`, and a misspelt figure fails
where it is written; its JSON form (`to_json`) is the flat object results.json has always held
(the same keys, in the same order), and `from_json` reads it back. A group of figures that is
measured or derived together (`PhaseTimings`, `PhaseFigures`) is a field of its own, absent
(None) when the run did not produce it; an optional field that is None is left out of the JSON,
as the run never wrote it, unless None is one of its values (`options`: the config's), where
`ABSENT` marks it unwritten.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

AR = "autoregressive"
PHASES = ("t_prefill", "t_draft", "t_verify")
# A phase timing whose spread across trials (max - min of the per-trial estimates) exceeds this
# fraction of its estimate is marked unreliable, as is one that is not positive: on a shared
# machine a difference of two noisy loop timings can come out at or below zero.
MAX_RELATIVE_SPREAD = 0.5
# The layout of results.json and of the tables' JSON files; a reader refuses any other.
SCHEMA_VERSION = 1


class _Absent:
  """The value of a field the run did not write, where None is a value it can hold."""

  def __repr__(self) -> str:
    return "ABSENT"


ABSENT = _Absent()


@dataclasses.dataclass(kw_only=True)
class PhaseTimings:
  """A method's phase timings (`profile_phases`), ms per round and their spreads across trials
  (max - min); they depend on the method's shapes, not on its prompts."""

  t_prefill_ms: float  # the prompt's forward and the drafter's init, on one prompt
  t_draft_ms: float  # 0 without a drafter
  t_verify_ms: float  # for autoregressive decoding: one decode step
  t_prefill_spread_ms: float
  t_draft_spread_ms: float
  t_verify_spread_ms: float
  prefill_chunks_timed: int  # prefill chunks of the prompt t_prefill_ms was timed on
  phases_reused: bool = False  # taken from an earlier call with the same shapes (`RunMemo`)

  def ms(self, phase: str) -> float:
    """The timing of `phase` (one of PHASES)."""
    return getattr(self, f"{phase}_ms")

  def spread_ms(self, phase: str) -> float:
    return getattr(self, f"{phase}_spread_ms")


@dataclasses.dataclass(kw_only=True)
class PhaseFigures:
  """What the phase timings give against the run's autoregressive record (`finish`). A ratio
  is None (JSON null) where a timing difference left its divisor not positive."""

  draft_share: float | None  # t_draft / (t_draft + t_verify)
  ideal_speedup: float | None  # tau x t_AR / (t_draft + t_verify): decoding without per-call costs
  ideal_speedup_e2e: float | None  # the same bound end to end, with every prefill
  loop_efficiency: float | None  # measured speedup / ideal_speedup_e2e
  unreliable_figures: list[str]  # PHASES, "autoregressive <phase>" or "loop_efficiency"
  unreliable: bool  # any of them


@dataclasses.dataclass(kw_only=True)
class MethodRecord:
  """One method's run over a set of prompts (`run_methods`), and what was added to it after."""

  method: str  # AR, a registered drafter or a folder's label
  tau: float  # emitted tokens / target calls, from the first pass
  tokens_per_second: float  # over every timed pass
  tokens_per_second_repeats: list[float]  # each pass's
  target_calls: int  # pooled over the rows each call served (batch > 1)
  new_tokens: int
  wall_seconds: float  # of the first pass
  acceptance_by_depth: list[float | None]  # None where no round reached that depth
  accepted_by_depth: list[int]  # rounds that accepted d nodes, d = 0..nodes
  batch_size: int
  outputs: list[list[int]] | None = None  # the generated tokens; None once left out (tables)
  prompts: int
  prefill_chunks: int  # every prompt's prefill chunks, summed over the run's batches
  draft_nodes: int  # 0 for autoregressive decoding
  # How a drafter's run drafted and verified (None for autoregressive decoding): the children it
  # drew ("top_k", "iid", "wor": `specjax.children`; "top_k" at T = 0 whatever it was built
  # with), the acceptance rule ("greedy" at T = 0, else `specjax.verify.Rule`'s name) and
  # whether that rule is lossy (typical acceptance: its output is not the target's).
  children: str | None = None
  rule: str | None = None
  lossy: bool = False
  phases: PhaseTimings | None = None  # None: not profiled
  param_bytes: dict[str, int] | None = None  # the drafter's bytes per device, on a mesh
  dataset: str | None = None
  prompt_set: dict[str, int] | None = None  # `PromptSet.summary()` of the benchmark's run
  temperature: float | None = None  # a reproduce table's run
  top_p: float | None = None  # ditto
  # The builder options it ran with, where the caller chose them (None: the config's).
  options: dict[str, Any] | None | _Absent = ABSENT
  speedup: float | None = None  # tokens/s over AR's in the same run (`add_speedups`)
  speedup_repeats: list[float] | None = None  # per timed pass
  matches_autoregressive: bool | None = None  # outputs equal AR's
  figures: PhaseFigures | None = None  # `finish`

  def to_json(self, outputs: bool = True) -> dict[str, Any]:
    """The flat JSON object of results.json: every field that is set, a group's fields in its
    place; without the generated tokens unless `outputs`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      unset = value is ABSENT or (value is None and f.default is None)
      if unset or (f.name == "outputs" and not outputs):
        continue
      if dataclasses.is_dataclass(value):
        out.update(dataclasses.asdict(value))
      else:
        out[f.name] = value
    return out

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> MethodRecord:
    """The record `to_json` wrote; a key no field holds is refused (another schema)."""
    d = dict(d)
    groups = {}
    for name, group in (("phases", PhaseTimings), ("figures", PhaseFigures)):
      keys = [f.name for f in dataclasses.fields(group)]
      if keys[0] in d:
        groups[name] = group(**{k: d.pop(k) for k in keys if k in d})
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)} - {"phases", "figures"})
    if unknown:
      raise ValueError(f"a method record holds {unknown}, which no field of schema "
                       f"{SCHEMA_VERSION} holds")
    return cls(**d, **groups)


@dataclasses.dataclass
class TableRow:
  """A table's row: a method's record and the figures the table adds (a subclass's fields),
  stored as the record's JSON with those figures after it."""

  record: MethodRecord

  def to_json(self, outputs: bool = True) -> dict[str, Any]:
    own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "record"}
    return {**self.record.to_json(outputs), **own}


@dataclasses.dataclass(frozen=True)
class OracleRow:
  """The loop's best case at one chain length (`benchmark.oracle_roofline`)."""

  n: int  # N, the oracle chain's nodes
  tau: float  # emitted tokens per target call (every node accepted)
  cost: float  # t_verify(N + 1) / t_AR: verifying N + 1 tokens, in autoregressive steps
  bound: float  # t_AR * (N + 1) / t_verify(N + 1)
  bound_tau: float  # the bound at the realised tau (the last round is cut at max_new)
  bound_e2e: float  # the bound at tau, with the prefill both runs pay
  speedup: float  # measured, fastest run against fastest autoregressive run


@dataclasses.dataclass(frozen=True)
class Roofline:
  """An oracle sweep: the autoregressive step it is measured against, and a row per N."""

  tokens_per_second: float  # autoregressive decoding's, fastest of the repeats
  t_step_ms: float  # an autoregressive round
  t_prefill_ms: float  # the prompt's prefill alone
  rows: tuple[OracleRow, ...]

  def to_json(self) -> dict[str, Any]:
    return {"tokens_per_second": self.tokens_per_second, "t_step_ms": self.t_step_ms,
            "t_prefill_ms": self.t_prefill_ms,
            "rows": [dataclasses.asdict(r) for r in self.rows]}


def read_results(path: str) -> tuple[dict[str, Any], list[MethodRecord]]:
  """A results.json: its object and its records, refused when another schema wrote it."""
  with open(path) as f:
    doc = json.load(f)
  if doc.get("schema_version") != SCHEMA_VERSION:
    raise ValueError(f"{path} holds results of schema {doc.get('schema_version')}, not "
                     f"{SCHEMA_VERSION}: rerun the benchmark")
  return doc, [MethodRecord.from_json(r) for r in doc["records"]]


def unreliable_timings(r: MethodRecord) -> list[str]:
  """The phase timings of a record that cannot be trusted: an estimate that is not positive, or
  whose spread across trials exceeds MAX_RELATIVE_SPREAD of it. A method without a drafter has
  no draft phase (t_draft is 0 by definition), so only its other phases are judged."""
  bad = []
  for name in PHASES:
    if name == "t_draft" and not r.draft_nodes:
      continue
    est, spread = r.phases.ms(name), r.phases.spread_ms(name)
    if est <= 0 or spread > MAX_RELATIVE_SPREAD * est:
      bad.append(name)
  return bad


def _ratio(a: float, b: float) -> float | None:
  """a / b, or None (JSON null) where a timing difference left b not positive."""
  return a / b if b > 0 else None


def add_speedups(records: Sequence[MethodRecord]) -> MethodRecord:
  """Adds to each record of one run its speedup over the run's AR record (overall and per
  repeat) and whether its outputs equal AR's; returns the AR record."""
  ar = next(r for r in records if r.method == AR)
  for r in records:
    r.speedup = r.tokens_per_second / ar.tokens_per_second
    r.speedup_repeats = [a / b for a, b in zip(r.tokens_per_second_repeats,
                                               ar.tokens_per_second_repeats)]
    r.matches_autoregressive = r.outputs == ar.outputs
  return ar


def _prefills(r: MethodRecord) -> float:
  """ms of every prefill of a record's run: its timed prefill per chunk, times the run's chunks."""
  return r.phases.t_prefill_ms * r.prefill_chunks / r.phases.prefill_chunks_timed


def finish(records: Sequence[MethodRecord]) -> None:
  """Adds speedup, and (`figures`) drafting share, ideal speedup and loop efficiency relative
  to AR, and which figures are unreliable."""
  ar = add_speedups(records)
  t_ar = ar.phases.t_verify_ms
  ar_bad = [f"autoregressive {name}" for name in unreliable_timings(ar)]
  for r in records:
    round_ms = r.phases.t_draft_ms + r.phases.t_verify_ms
    # End to end both pay a prefill per prompt: AR then one step per further token, the method
    # its rounds. The prefill, timed alone on one prompt, is scaled to each prompt by its number
    # of prefill chunks (`rounds.prefill_chunks`). The loop is judged against this bound.
    n = len(r.outputs)
    ar_ms = _prefills(ar) + (ar.new_tokens - n) * t_ar
    e2e = _ratio(ar_ms, _prefills(r) + (r.target_calls - n) * round_ms)
    efficiency = _ratio(r.speedup, e2e or 0.0)
    bad = unreliable_timings(r) + ([] if r is ar else ar_bad)
    # Above 100% the measured run beat its own bound: the bound's timings were off.
    if efficiency is None or efficiency > 1.0:
      bad.append("loop_efficiency")
    r.figures = PhaseFigures(
        draft_share=_ratio(r.phases.t_draft_ms, round_ms),
        ideal_speedup=_ratio(r.tau * t_ar, round_ms), ideal_speedup_e2e=e2e,
        loop_efficiency=efficiency, unreliable_figures=bad, unreliable=bool(bad))
