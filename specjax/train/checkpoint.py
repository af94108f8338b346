"""Orbax checkpointing of a training state pytree, with clear errors and exact resume.

A checkpoint holds global arrays, whatever mesh wrote them: each process writes its shards, and a
restore reads onto the shardings the caller asks for (one device, or any mesh), so a run saved
on one mesh resumes on another.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Periodic saves of `{"params", "opt_state", "step", ...}` under `directory`; resumes latest.

  Orbax runs saves on background threads: `close` (or leaving a `with Checkpointer(...)` block,
  on errors too) waits for them and stops the threads.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3):
    self.directory = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(self.directory)
    os.makedirs(parent, exist_ok=True)
    if not os.access(parent, os.W_OK):
      raise ValueError(f"checkpoint directory {self.directory} is not writable")
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, *, force: bool = False) -> None:
    # Already atomic, so not wrapped in specjax.files: on a local file system Orbax writes a
    # step into `<step>.orbax-checkpoint-tmp...` and renames it to `<step>` only once every
    # file is written (AtomicRenameTemporaryPath.finalize, orbax/checkpoint/_src/path/
    # atomicity.py, the default outside GCS: atomicity_defaults.py), and latest_step and
    # restore see finalized steps only, so an interrupted save leaves the previous step whole.
    self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

  def restore(self, state_like: Any, step: int | None = None) -> Any:
    """Restores into the structure, shapes, dtypes and shardings of `state_like`'s leaves
    (arrays, or `jax.ShapeDtypeStruct`s with a `sharding`): each array comes back laid out as
    its counterpart is, whatever mesh saved it. A leaf without a sharding (a numpy array, a
    ShapeDtypeStruct without one) restores onto the default device."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise ValueError(f"no checkpoint to restore in {self.directory}")
    abstract = jax.tree.map(_abstract, state_like)
    try:
      return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # orbax raises assorted errors for truncated / foreign checkpoints
      raise ValueError(f"checkpoint {self.directory}/{step} is corrupt or does not match this "
                       f"model and optimizer: {type(e).__name__}: {e}") from e

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _abstract(leaf: Any) -> Any:
  """The restore target of one leaf: its shape, dtype and sharding (the default device's when it
  has none, rather than whatever layout the checkpoint recorded)."""
  out = ocp.utils.to_shape_dtype_struct(leaf)
  if isinstance(out, jax.ShapeDtypeStruct) and out.sharding is None:
    out = jax.ShapeDtypeStruct(out.shape, out.dtype,
                               sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  return out
