"""Multi-process (multi-host) runs: one call to join the processes before JAX starts.

JAX runs one Python process per host (multi-controller): every process runs the same program on
the same global values, `jax.devices()` lists the devices of *all* processes, and a mesh from
`specjax.sharding.make_mesh` spans them, so `generate` and the trainers run unchanged once the
processes have joined. Joining is `initialize`, which must run before anything starts JAX's
backend (a computation, `jax.devices()`, a `device_put`).

Where the settings come from, in order:

  * explicit arguments (`--coordinator HOST:PORT --num-processes N --process-id I` on the
    command line, `add_arguments` / `from_args`);
  * the environment: `JAX_COORDINATOR_ADDRESS` (read by JAX itself), `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` (read here: JAX's own initializer does not read these two);
  * `coordinator="auto"` (`--coordinator auto`): JAX's cluster auto-detection fills in whatever
    is unset, on a Cloud TPU pod slice (GCE or GKE), under Slurm, Open MPI, or a Kubernetes
    job; `JAX_COORDINATOR_PORT` then picks the coordinator's port.

With none of them, or with one process, `initialize` starts nothing: a single-process run is
unchanged. On CPU the processes' collectives go over gloo (TCP). The number of CPU devices per
process is `cpu_devices` (or JAX's `JAX_NUM_CPU_DEVICES`); it too must be set before the
backend starts. A coordinator on a loopback address (127.0.0.1, localhost, ::1) listens on that
address only, not on every interface.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from typing import Any, NamedTuple

import jax

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
AUTO = "auto"


class ProcessInfo(NamedTuple):
  """This process's place in the run (0 of 1 for a single-process run)."""

  process_id: int
  num_processes: int


def _backend_started() -> bool:
  from jax._src import xla_bridge  # no public equivalent that does not start the backend
  return xla_bridge.backends_are_initialized()


def _int(name: str, value: Any, source: str) -> int | None:
  if value is None:
    return None
  if isinstance(value, str):
    try:
      value = int(value.strip())
    except ValueError:
      raise ValueError(f"{name} from {source} must be an int, got {value!r}") from None
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
  return value


def _from_env(name: str, value: Any, env: str) -> tuple[Any, str]:
  """`value` if given, else the environment variable `env` (None when unset or empty)."""
  if value is not None:
    return value, "the arguments"
  return os.environ.get(env) or None, env


def check_coordinator(address: str) -> tuple[str, int]:
  """`HOST:PORT` (an IPv6 host in brackets, `[::1]:1234`) -> (host, port); ValueError naming
  the problem otherwise."""
  host, sep, port = address.rpartition(":")
  if not sep or not host:
    raise ValueError(f"coordinator {address!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
  try:
    port_no = int(port)
  except ValueError:
    raise ValueError(f"coordinator {address!r}: port {port!r} is not an int") from None
  if not 0 < port_no < 65536:
    raise ValueError(f"coordinator {address!r}: port {port_no} is outside 1..65535")
  return host.strip("[]"), port_no


def _is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _cpu_devices_fixed_elsewhere() -> bool:
  """Whether the environment already sets the number of CPU devices (XLA's host-platform flag or
  JAX's variable), which `cpu_devices="auto"` then leaves as it is."""
  return ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
          or bool(os.environ.get("JAX_NUM_CPU_DEVICES")))


def cpu_devices_free() -> bool:
  """Whether this process may still choose its number of CPU devices: JAX's backend has not
  started and the environment does not fix the count."""
  return not _backend_started() and not _cpu_devices_fixed_elsewhere()


def _set_cpu_devices(cpu_devices: int | str | None) -> None:
  if cpu_devices is None:
    return
  if cpu_devices == AUTO:
    # One device per core, for `mesh="auto"` (`sharding.auto_mesh`), unless the environment or
    # an earlier start of the backend has already fixed the count.
    if _backend_started() or _cpu_devices_fixed_elsewhere():
      return
    from specjax.sharding import host_cores
    cpu_devices = host_cores()
  cpu_devices = _int("cpu_devices", cpu_devices, "the arguments")
  if cpu_devices < 1:
    raise ValueError(f"cpu_devices must be >= 1, got {cpu_devices}")
  if _backend_started():
    have = len(jax.local_devices(backend="cpu"))
    if have != cpu_devices:
      raise RuntimeError(f"cpu_devices={cpu_devices} asked after JAX's backend started with "
                         f"{have} CPU devices: call specjax.distributed.initialize before any "
                         "JAX computation or jax.devices()")
    return
  jax.config.update("jax_num_cpu_devices", cpu_devices)


def _use_gloo() -> None:
  """Cross-process CPU collectives over gloo, unless another implementation (MPI) was chosen.
  The setting only concerns the CPU client, so it is harmless on TPU and GPU hosts."""
  if jax.config.jax_cpu_collectives_implementation in (None, "gloo"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _already_joined(coordinator: str | None, num_processes: int | None,
                    process_id: int | None) -> ProcessInfo:
  """A second call is fine when it asks for the run this process already joined."""
  from jax._src import distributed as state_module
  state = state_module.global_state
  asked = {"coordinator": (coordinator, state.coordinator_address),
           "num_processes": (num_processes, state.num_processes),
           "process_id": (process_id, state.process_id)}
  clash = [f"{k} {a!r} (joined: {b!r})" for k, (a, b) in asked.items()
           if a is not None and a != AUTO and a != b]
  if clash:
    raise RuntimeError("this process already joined another multi-process run: "
                       + ", ".join(clash))
  return ProcessInfo(state.process_id, state.num_processes)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu_devices: int | str | None = None,
               initialization_timeout: int = 300) -> ProcessInfo:
  """Joins this process to a multi-process run (`jax.distributed.initialize`), or does nothing
  for a single process; returns this process's id and the number of processes.

  coordinator: `HOST:PORT` of process 0's coordinator service (process 0 listens there, every
  process connects to it), or "auto" for JAX's cluster auto-detection (TPU pods, Slurm, Open
  MPI, Kubernetes). num_processes, process_id: the run's size and this process's rank in
  0..num_processes-1. Each unset one falls back to its environment variable (module docstring).
  cpu_devices: the number of CPU devices this process gets (CPU runs; before the backend starts),
    or "auto": one per core, unless the environment (`XLA_FLAGS`' host-platform device count,
    `JAX_NUM_CPU_DEVICES`) or an earlier start of the backend has fixed the count.
  initialization_timeout: seconds to wait for every process to connect.

  Raises ValueError for inconsistent settings (a process_id outside the range, several processes
  without a coordinator, a malformed address) and RuntimeError when the backend has already
  started (joining must come first) or this process already joined another run. Calling it again
  with the settings of the run already joined returns that run's info.
  """
  coordinator, _ = _from_env("coordinator", coordinator, ENV_COORDINATOR)
  num_raw, num_src = _from_env("num_processes", num_processes, ENV_NUM_PROCESSES)
  pid_raw, pid_src = _from_env("process_id", process_id, ENV_PROCESS_ID)
  num_processes = _int("num_processes", num_raw, num_src)
  process_id = _int("process_id", pid_raw, pid_src)
  if coordinator is not None and not isinstance(coordinator, str):
    raise ValueError(f"coordinator must be a 'HOST:PORT' string or 'auto', got {coordinator!r}")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes} (from {num_src})")
  if process_id is not None and not 0 <= process_id < (num_processes or 1 << 31):
    bound = f"[0, {num_processes})" if num_processes else "non-negative"
    raise ValueError(f"process_id {process_id} (from {pid_src}) must be {bound}")

  if jax.distributed.is_initialized():
    _set_cpu_devices(cpu_devices)
    return _already_joined(coordinator, num_processes, process_id)

  auto = coordinator == AUTO
  if not auto:
    if num_processes in (None, 1):
      if coordinator is not None and num_processes is None:
        raise ValueError(f"coordinator {coordinator!r} given without num_processes: pass "
                         f"--num-processes (or set {ENV_NUM_PROCESSES})")
      if process_id not in (None, 0):
        raise ValueError(f"process_id {process_id} given for a single-process run: pass "
                         f"--num-processes (or set {ENV_NUM_PROCESSES})")
      _set_cpu_devices(cpu_devices)
      return ProcessInfo(0, 1)  # one process: nothing to join
    if coordinator is None:
      raise ValueError(f"{num_processes} processes need a coordinator: pass --coordinator "
                       f"HOST:PORT (process 0's address; or set {ENV_COORDINATOR})")
    if process_id is None:
      raise ValueError(f"{num_processes} processes need this process's id: pass --process-id "
                       f"I with I in [0, {num_processes}) (or set {ENV_PROCESS_ID})")
    check_coordinator(coordinator)

  if _backend_started():
    raise RuntimeError("specjax.distributed.initialize must run before anything starts JAX's "
                       "backend (a computation, jax.devices(), jax.device_put): call it first "
                       "thing in the program")
  _set_cpu_devices(cpu_devices)
  _use_gloo()
  kwargs: dict[str, Any] = {"initialization_timeout": initialization_timeout}
  if not auto:
    host, port = check_coordinator(coordinator)
    kwargs.update(coordinator_address=coordinator, num_processes=num_processes,
                  process_id=process_id)
    if _is_loopback(host) and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
      kwargs["coordinator_bind_address"] = coordinator  # not every interface
  else:
    kwargs.update(num_processes=num_processes, process_id=process_id)
  try:
    jax.distributed.initialize(**kwargs)
  except ValueError as e:
    if not auto:
      raise
    raise ValueError(f"coordinator 'auto': no TPU pod, Slurm, Open MPI or Kubernetes cluster "
                     f"gave the missing settings ({e}); pass --coordinator HOST:PORT "
                     "--num-processes N --process-id I instead") from e
  from jax._src import distributed as state_module
  state = state_module.global_state
  return ProcessInfo(state.process_id, state.num_processes)


def is_main_process() -> bool:
  """True on process 0 (and in a single-process run): the one that prints results and writes
  files, so a multi-process run writes each once."""
  return jax.process_index() == 0


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Adds `--coordinator`, `--num-processes` and `--process-id` (all optional: unset, they come
  from the environment, and without any the run is single-process)."""
  group = parser.add_argument_group(
      "multi-process", "run one process per host, each with the same command and its own "
      f"--process-id (defaults: ${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})")
  group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="process 0's address and a free port, or 'auto' to detect the "
                     "cluster (TPU pod, Slurm, Open MPI, Kubernetes)")
  group.add_argument("--num-processes", type=int, default=None, metavar="N",
                     help="number of processes in the run")
  group.add_argument("--process-id", type=int, default=None, metavar="I",
                     help="this process's rank, 0..N-1 (0 prints and writes the results)")
  group.add_argument("--cpu-devices", type=_cpu_devices_arg, default=None, metavar="N|auto",
                     help="CPU devices of this process: N, or auto (one per core, what a "
                     "config's mesh=auto spreads the model over; the default of the entry "
                     "points whose configs use it)")
  return parser


def _cpu_devices_arg(text: str) -> int | str:
  if text.strip() == AUTO:
    return AUTO
  try:
    n = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {text!r}") from None
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {n}")
  return n


def from_args(args: argparse.Namespace, *, cpu_devices: int | str | None = None) -> ProcessInfo:
  """`initialize` with the flags of `add_arguments` (a namespace without them: single-process
  unless the environment says otherwise); `--cpu-devices` wins over `cpu_devices`."""
  flag = getattr(args, "cpu_devices", None)
  return initialize(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                    getattr(args, "process_id", None),
                    cpu_devices=cpu_devices if flag is None else flag)
