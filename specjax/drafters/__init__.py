"""Drafters, one file per family, behind one protocol (`specjax.drafters.base.Drafter`).

  specjax.drafters.available(target)            -> names usable with this target
  specjax.drafters.build(name, target, **opts)  -> a drafter for generate(..., drafter=...)

A new drafter is a file that defines a protocol-conforming pytree and registers a builder with
`specjax.drafters.registry.register("name")`; the benchmark then picks it up without edits. This
package only re-exports: importing it imports every family file, which registers itself, and
every published layout's reader (`formats`; `eagle3_format.py`, ...), which registers itself
with `formats` and imports its family.
"""

from specjax.drafters import (  # noqa: F401
                              dflash,
                              draft_lm,
                              eagle,
                              eagle3,
                              hydra,
                              layer_skip,
                              medusa,
                              ngram,
                              prompt_lookup,
                              token_recycling,
)
from specjax.drafters.base import Drafter, NoDrafter
from specjax.drafters.registry import available, build, describe, names, register

# The published layouts, in the order that `formats` lists them in its errors.
# isort: off
from specjax.drafters import eagle3_format, eagle_format, medusa_format, dflash_format  # noqa: F401
# isort: on

__all__ = ["Drafter", "NoDrafter", "available", "build", "describe", "names", "register"]
