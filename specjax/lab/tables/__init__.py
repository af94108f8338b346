"""The results tables of `python -m experiments.reproduce <table>`, one file each: its config
(a frozen dataclass of the table's own fields, which the job's config holds as its field
`<name>_table`), `build` and `units`, registered here by name in the order `all` runs them.

A new table is a file beside these with its config and `TABLE = Table(...)`, its line below
and its config's field in `specjax.lab.reproduce.ReproduceConfig`.

  methods  tau and speedup of every method per dataset at T = 0, T = 0.7 with top-p 0.9 and
           T = 1, batch 1 (Spec-Bench / EAGLE-3 layout), each row naming its children and rule;
           speedup is the mean and spread over `timing_repeats` passes
  sampling per learned drafter at T = 1: tau and speedup with top-k, i.i.d. and without-
           replacement children under each acceptance rule (typical acceptance marked LOSSY)
  depth    acceptance rate by draft depth of every learned drafter
  theory   Leviathan et al.'s expected tokens per call (1 - a^(g+1)) / (1 - a) and expected
           speedup at the measured acceptance and costs, against the measured ones, chains g
  budget   tau and speedup against tree size for EAGLE and DFlash, with the oracle's roofline
  peers    transformers' generate, assisted generation and prompt lookup beside specjax's
  batch    tokens/s and tau at several batch sizes (rows accept raggedly)
"""

from __future__ import annotations

from specjax.lab.session import Table
from specjax.lab.tables import batch, budget, depth, methods, peers, sampling, theory

TABLES: dict[str, Table] = {t.name: t for t in (
    methods.TABLE, sampling.TABLE, depth.TABLE, theory.TABLE, budget.TABLE, peers.TABLE,
    batch.TABLE)}
