"""Shared fixtures: tiny random transformers checkpoints, built and saved once per session.

The session runs with 8 CPU devices (set here, before JAX starts), so the multi-device tests
share the session with the rest; arrays not placed on a mesh live on device 0 as usual.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import pytest

NUM_CPU_DEVICES = 8
# Compile time dominates the suite (hundreds of tiny programs that run in milliseconds): LLVM's
# expensive optimisation passes only slow compilation down. They do not change float semantics
# (no fast-math either way), so the tests check the same arithmetic users run.
_TEST_XLA_FLAGS = {
    "xla_force_host_platform_device_count": str(NUM_CPU_DEVICES),
    "xla_backend_optimization_level": "0",
    "xla_llvm_disable_expensive_passes": "true",
}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"--{k}={v}" for k, v in _TEST_XLA_FLAGS.items()
                                               if k not in _flags]).strip()
# On a GPU every xdist worker is a JAX process of its own, and each would take 75% of the GPU's
# memory at start (JAX's default preallocation): the second worker would fail to allocate.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The experiment entry points turn JAX's persistent compilation cache on by default; tests that
# call them in-process must not write into the user's cache (tests/test_compile_cache.py gives
# its subprocesses a folder of their own).
os.environ["SPECJAX_COMPILE_CACHE"] = "off"

MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
  """`-n auto` (pyproject's addopts): a worker per core, at most MAX_WORKERS. Each worker holds a
  JAX runtime of 8 emulated devices and its compiled programs; tests are compile-bound and
  single-threaded, so more workers than cores only contend."""
  return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A tiny HF checkpoint on disk, the transformers model it came from, and specjax's load of it."""

  variant: str
  path: pathlib.Path
  hf_model: Any  # transformers *ForCausalLM, float32, eval mode
  target: Any  # specjax.Target loaded from `path` in float32


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each test module. A full run compiles hundreds of
  generate programs (one per drafter, batch and shape); kept for the whole session their
  executables add up on the 24 GiB CI machine, and a module never needs another's."""
  yield
  from specjax import decoding
  decoding.release_compiled()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
  """`hf_checkpoint(variant) -> Checkpoint`, saving and loading each variant once per session."""
  import torch

  import specjax
  from tests.helpers import (
    hf_models,  # imports torch + transformers: only for the tests that use checkpoints
  )

  # The models are tiny and the CI machine has 2 shared cores: torch's intra-op thread pool then
  # only adds contention (transformers' generate measured 15-30x slower with 2 threads than 1).
  torch.set_num_threads(1)

  cache: dict[str, Checkpoint] = {}

  def get(variant: str) -> Checkpoint:
    if variant not in cache:
      path = tmp_path_factory.mktemp(f"hf_{variant}")
      model = hf_models.save_hf_model(variant, path)
      cache[variant] = Checkpoint(variant, path, model, specjax.load_target(path))
    return cache[variant]

  return get
