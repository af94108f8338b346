"""Multi-process runs: two local processes of 4 CPU devices each form one 8-device dp=2,tp=4 mesh
and get what one process with 8 devices gets (greedy tokens of `generate`, losses of
`train.loop.train`); `specjax.distributed.initialize` refuses inconsistent settings clearly.

The processes talk over the loopback address only (coordinator on 127.0.0.1, gloo collectives).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from specjax import distributed
from tests.helpers import multihost_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_PROCESSES, CPU_DEVICES = 2, 4
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
  # The session's 8-device flag (conftest) is not the workers': they get --cpu-devices.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
               distributed.ENV_PROCESS_ID, "JAX_NUM_CPU_DEVICES"):
    env.pop(name, None)
  return env


def _launch(out_dir) -> list[tuple[subprocess.Popen, str]]:
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = []
  for i in range(NUM_PROCESSES):
    log = os.path.join(out_dir, f"worker_{i}.log")
    with open(log, "w") as f:
      procs.append((subprocess.Popen(
          [sys.executable, "-m", "tests.helpers.multihost_worker", "--coordinator", coordinator,
           "--num-processes", str(NUM_PROCESSES), "--process-id", str(i),
           "--cpu-devices", str(CPU_DEVICES), "--out", str(out_dir)],
          cwd=ROOT, env=_worker_env(), stdout=f, stderr=subprocess.STDOUT), log))
  return procs


def _logs(procs) -> str:
  parts = []
  for i, (p, log) in enumerate(procs):
    with open(log) as f:
      text = f.read()
    parts.append(f"--- worker {i} (exit status {p.returncode}) ---\n{text[-6000:]}")
  return "\n".join(parts)


def _wait(procs, deadline: float) -> None:
  """Waits for every worker until `deadline`; on a timeout or a failed worker, kills the rest and
  fails with both workers' output."""
  try:
    for p, _ in procs:
      p.wait(timeout=max(deadline - time.monotonic(), 0.1))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  if any(p.returncode != 0 for p, _ in procs):
    pytest.fail(f"a worker failed or ran past {TIMEOUT_S} s:\n{_logs(procs)}")


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  """Each worker sees 8 global devices, 4 its own, and a mesh spanning both processes; its greedy
  decoding (autoregressive and speculative, unequal prompt lengths) and its training losses are
  those of this process on one device, which computes them while the workers run."""
  start = time.monotonic()
  procs = _launch(tmp_path)
  try:
    reference = multihost_worker.generate_case(None)
    reference_losses = multihost_worker.train_case(None)
  except BaseException:
    _wait(procs, time.monotonic())  # the reference failed: stop the workers now
    raise
  _wait(procs, start + TIMEOUT_S)
  records = []
  for i in range(NUM_PROCESSES):
    with open(tmp_path / f"process_{i}.json") as f:
      records.append(json.load(f))
  assert set(reference) == {"autoregressive", "prompt_lookup"}
  assert reference["prompt_lookup"]["tokens"] == reference["autoregressive"]["tokens"]
  assert reference["prompt_lookup"]["tau"] > 1.0  # drafts were accepted: a speculative run
  assert len({len(p) for p in multihost_worker.PROMPTS}) == len(multihost_worker.PROMPTS)
  assert all(len(t) == multihost_worker.MAX_NEW_TOKENS
             for t in reference["autoregressive"]["tokens"])
  for i, r in enumerate(records):
    context = f"process {i}:\n{_logs(procs)}"
    assert (r["process_id"], r["num_processes"]) == (i, NUM_PROCESSES), context
    assert (r["process_index"], r["process_count"]) == (i, NUM_PROCESSES), context
    assert (r["local_devices"], r["devices"]) == (CPU_DEVICES, NUM_PROCESSES * CPU_DEVICES)
    assert r["mesh_processes"] == list(range(NUM_PROCESSES)) and r["main"] == (i == 0)
    assert r["rejoin"] == [i, NUM_PROCESSES] and "already joined another" in r["other_run"]
    for method, ref in reference.items():
      assert r["generate"][method]["tokens"] == ref["tokens"], (method, context)
      assert r["generate"][method]["tau"] == pytest.approx(ref["tau"]), (method, context)
    assert len(r["losses"]) == multihost_worker.TRAIN_STEPS
    np.testing.assert_allclose(r["losses"], reference_losses, rtol=1e-5, err_msg=context)
  assert reference_losses[-1] != reference_losses[0]  # the steps changed the params


# -- refusals (no processes started) -----------------------------------------------------------


@pytest.fixture
def no_env(monkeypatch):
  for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
               distributed.ENV_PROCESS_ID):
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


@pytest.mark.parametrize("kwargs,message", [
    (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), r"must be \[0, 2\)"),
    (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=-1), r"must be \[0, 2\)"),
    (dict(num_processes=2, process_id=0), "2 processes need a coordinator"),
    (dict(coordinator="127.0.0.1:1234", num_processes=2), "need this process's id"),
    (dict(coordinator="127.0.0.1:1234"), "without num_processes"),
    (dict(process_id=1), "single-process run"),
    (dict(coordinator="127.0.0.1", num_processes=2, process_id=0), "must be HOST:PORT"),
    (dict(coordinator="127.0.0.1:http", num_processes=2, process_id=0), "is not an int"),
    (dict(coordinator="127.0.0.1:70000", num_processes=2, process_id=0), "outside 1..65535"),
    (dict(num_processes=0), "must be >= 1"),
    (dict(num_processes=True), "must be an int"),
])
def test_initialize_refuses_bad_settings(no_env, kwargs, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize(**kwargs)


def test_initialize_reads_the_environment(no_env):
  no_env.setenv(distributed.ENV_NUM_PROCESSES, "2")
  no_env.setenv(distributed.ENV_PROCESS_ID, "5")
  with pytest.raises(ValueError, match=r"process_id 5 \(from JAX_PROCESS_ID\) must be \[0, 2\)"):
    distributed.initialize(coordinator="127.0.0.1:1234")
  no_env.setenv(distributed.ENV_PROCESS_ID, "one")
  with pytest.raises(ValueError, match="process_id from JAX_PROCESS_ID must be an int"):
    distributed.initialize()
  no_env.setenv(distributed.ENV_PROCESS_ID, "0")
  with pytest.raises(ValueError, match="need a coordinator"):
    distributed.initialize()
  no_env.setenv(distributed.ENV_NUM_PROCESSES, "1")
  assert distributed.initialize() == (0, 1)  # one process: nothing to join


def test_initialize_is_a_no_op_for_one_process(no_env):
  """This session's backend has started: one process still passes (nothing to join), several
  are refused with the reason, and so is a CPU device count the backend did not start with."""
  jax.devices()
  assert distributed.initialize() == distributed.ProcessInfo(0, 1)
  assert distributed.initialize("127.0.0.1:1234", 1, 0) == (0, 1)
  assert distributed.initialize(cpu_devices=jax.local_device_count("cpu")) == (0, 1)
  assert distributed.is_main_process() and not jax.distributed.is_initialized()
  with pytest.raises(RuntimeError, match="must run before anything starts JAX's backend"):
    distributed.initialize("127.0.0.1:1234", 2, 0)
  with pytest.raises(RuntimeError, match="asked after JAX's backend started"):
    distributed.initialize(cpu_devices=jax.local_device_count("cpu") + 1)


def test_auto_detection_without_a_cluster_says_so():
  """'auto' asks JAX's cluster detection; on a machine in no cluster the refusal names the
  explicit flags (in a fresh process: joining must come before the backend starts)."""
  code = ("from specjax import distributed\n"
          "try:\n  distributed.initialize('auto')\n"
          "except ValueError as e:\n  print(e)\n")
  env = {k: v for k, v in _worker_env().items()  # whatever cluster the test host is in
         if not k.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "PMI_"))}
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "no TPU pod, Slurm, Open MPI or Kubernetes cluster" in r.stdout, r.stdout + r.stderr
  assert "--coordinator HOST:PORT" in r.stdout


def test_flags(no_env):
  import argparse
  parser = distributed.add_arguments(argparse.ArgumentParser())
  args = parser.parse_args(["--coordinator", "10.0.0.1:1234", "--num-processes", "4",
                            "--process-id", "3"])
  assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.1:1234", 4, 3)
  assert distributed.from_args(parser.parse_args([])) == (0, 1)
  assert distributed.from_args(argparse.Namespace()) == (0, 1)  # a parser without the flags
  with pytest.raises(ValueError, match=r"must be \[0, 4\)"):
    distributed.from_args(parser.parse_args(["--num-processes", "4", "--process-id", "4"]))
