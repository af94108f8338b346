"""One process of the multi-process test (tests/test_multihost.py), and the cases it runs.

  python -m tests.helpers.multihost_worker --coordinator 127.0.0.1:PORT --num-processes 2 \
      --process-id I --cpu-devices 4 --out DIR

Each process joins the run (`specjax.distributed.initialize`), builds the dp=2,tp=4 mesh over
the devices of all processes, runs `generate_case` and `train_case` on it and writes what it
got to DIR/process_I.json. The test runs the same two functions in its own process on one
device for the reference, so both sides run the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MESH = "dp=2,tp=4"
# Unequal prompt lengths (one long enough that prompt lookup finds repeats to propose).
PROMPTS = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "import os\n\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
           "    def push(self, x):\n        self.items.append(x)\n\n"
           "    def pop(self):\n        return self.items",
           "for i in range(10):\n    print(")
MAX_NEW_TOKENS = 16
DRAFTERS = (None, "prompt_lookup")  # None: autoregressive
TRAIN_STEPS = 3
TRAIN_BATCH, TRAIN_SEQ = 8, 16


def generate_case(mesh, log=lambda what: None) -> dict[str, dict]:
  """Greedy decoding of the embedded target on `mesh` (None: one device) with each of
  DRAFTERS (a batch of 4 prompts of unequal lengths): by method name, the new tokens per row
  and tau (emitted tokens per target call)."""
  from specjax import assets, drafters
  from specjax.decoding import generate
  from specjax.interop import hf
  target = hf.load_target(assets.TARGET_DIR, dtype="float32")
  target = target if mesh is None else target.on_mesh(mesh)
  log("target loaded")
  prompts = [target.encode(p) for p in PROMPTS]
  out = {}
  for name in DRAFTERS:
    drafter = None if name is None else drafters.build(name, target)
    result = generate(target, prompts, max_new_tokens=MAX_NEW_TOKENS, drafter=drafter)
    out[name or "autoregressive"] = {"tokens": result.tokens, "tau": result.stats.tau}
    log(f"generated with {name or 'autoregressive'} "
        f"(compiled in {result.stats.compile_seconds:.1f} s)")
  return out


def _train_model():
  from specjax.models.config import ModelConfig
  # Heads, MLP units and vocabulary split over tp=4; 2 KV heads are replicated (the KV-head rule).
  return ModelConfig(architecture="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                     max_position_embeddings=64)


def train_case(mesh, log=lambda what: None) -> list[float]:
  """The loss of each of TRAIN_STEPS steps of the trainers' loop (`specjax.train.loop.train`)
  for a tiny LM, on one device (`mesh` None) or on `mesh`: params tensor-parallel by the
  partition rules, optimiser state like them, batch rows over `data`. Every process computes the
  same host values (params from one seed, batches from the step) and the loop places only its
  own devices' shards."""
  import jax
  import numpy as np
  import optax

  from specjax import sharding
  from specjax.data.pipeline import LMBatch
  from specjax.models import decoder
  from specjax.train import loop
  from specjax.train.target_lm import lm_loss

  cfg = _train_model()
  params = jax.tree.map(np.asarray, decoder.init_params(cfg, 0))  # the same on every process
  shardings = None if mesh is None else sharding.param_shardings(cfg, params, mesh)
  log("params built")

  def batches(start: int):
    for step in range(start, TRAIN_STEPS):
      tokens = np.random.default_rng(step).integers(0, cfg.vocab_size,
                                                    (TRAIN_BATCH, TRAIN_SEQ + 1), np.int32)
      yield LMBatch(inputs=tokens[:, :-1], targets=tokens[:, 1:])

  result = loop.train(lambda p, b: lm_loss(cfg, p, b), params, optax.adam(3e-3), batches,
                      loop.LoopConfig(total_steps=TRAIN_STEPS, log_every=1), progress=False,
                      mesh=mesh, param_shardings=shardings)
  return [r["loss"] for r in result.history]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  from specjax import distributed
  distributed.add_arguments(parser)  # with --cpu-devices, which the workers are given
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  info = distributed.from_args(args)

  import jax

  from specjax import sharding
  mesh = sharding.make_mesh(MESH)
  record = {"process_id": info.process_id, "num_processes": info.num_processes,
            "process_index": jax.process_index(), "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(), "devices": jax.device_count(),
            "mesh_processes": sorted({d.process_index for d in mesh.devices.flat}),
            "main": distributed.is_main_process()}
  # Joining again with the same settings is allowed; asking for another rank is refused.
  record["rejoin"] = list(distributed.from_args(args))
  try:
    other = (info.process_id + 1) % info.num_processes
    distributed.initialize(args.coordinator, args.num_processes, other)
    record["other_run"] = "accepted"
  except RuntimeError as e:
    record["other_run"] = str(e)
  start = time.perf_counter()

  def log(what: str) -> None:  # progress on stderr, which the test prints when a worker fails
    print(f"process {info.process_id} at {time.perf_counter() - start:.1f} s: {what}",
          file=sys.stderr, flush=True)

  log(f"joined: {record}")
  record["generate"] = generate_case(mesh, log)
  record["losses"] = train_case(mesh, log)
  log("trained")
  path = os.path.join(args.out, f"process_{info.process_id}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(record, f)
  os.replace(path + ".tmp", path)


if __name__ == "__main__":
  main()
