"""Method records for tests of what reads them (tables, results files), without a run."""

from __future__ import annotations

from typing import Any

from specjax.lab.records import AR, MethodRecord

# What a one-prompt, one-token autoregressive run records; a test sets the fields it reads.
_SMALL_RUN = dict(method=AR, tau=1.0, tokens_per_second=1.0, tokens_per_second_repeats=[1.0],
                  target_calls=1, new_tokens=1, wall_seconds=1.0, acceptance_by_depth=[],
                  accepted_by_depth=[], batch_size=1, prompts=1, prefill_chunks=1,
                  draft_nodes=0)


def record(**fields: Any) -> MethodRecord:
  """The record whose JSON form holds `fields` (results.json's flat keys: `t_draft_ms`, ...),
  the other fields a small run's."""
  return MethodRecord.from_json({**_SMALL_RUN, **fields})
