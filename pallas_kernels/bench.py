"""Tree-attention benchmark: the Pallas kernel vs its jnp reference vs implementations passed in.

Each (S, N) point is one verification-shaped call with every row's cache full (length = S - N),
so exactly S slots of K and V are live. Reported per implementation: median time, the achieved
bandwidth of that KV read (live bytes / time, the same numerator for all so they compare),
and on a known accelerator the fraction of its peak memory bandwidth. On CPU the kernel can only
run in interpret mode: it is checked against the reference (the tolerance policy of
tests/pallas_kernels) and its timing is not meaningful; sizes above `cpu_max_size` are skipped.
Extra implementations (`impls`) take the kernel's arguments, `fn(q, k_cache, v_cache, length,
tree_mask, *, sm_scale)`, so this module needs nothing but jax; `experiments/bench_kernels.py`,
the command-line entry point, passes the model's XLA attention that way.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_attention import kv_bytes_read, tree_attention, tree_attention_reference

# Peak HBM bandwidth (bytes/s) by a substring of `device.device_kind`, from vendor data sheets.
PEAK_BYTES_PER_S = {
    "H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 3.0e11,
    "TPU v6 lite": 1.64e12, "TPU v5 lite": 8.19e11, "TPU v5p": 2.765e12, "TPU v5": 2.765e12,
    "TPU v4": 1.2e12,
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # tests/pallas_kernels/test_tree_attention.py


@dataclasses.dataclass(frozen=True)
class Row:
  size: int  # S
  nodes: int  # N
  impl: str  # "pallas" | "reference" | a name of `impls`
  seconds: float | None  # median; None when skipped
  kv_bytes: int
  peak: float | None  # bytes/s of the device, when known
  max_err: float | None = None  # kernel vs reference (pallas rows only)
  note: str = ""

  @property
  def bytes_per_s(self) -> float | None:
    return self.kv_bytes / self.seconds if self.seconds else None


def peak_bandwidth(device=None) -> float | None:
  kind = (device or jax.devices()[0]).device_kind
  for name, peak in PEAK_BYTES_PER_S.items():  # most specific names first
    if name.lower() in kind.lower():
      return peak
  return None


def random_tree_mask(rng: np.random.Generator, b: int, n: int) -> np.ndarray:
  """bool[B, N, N] ancestor-or-self of random trees with parent(i) < i."""
  mask = np.zeros((b, n, n), bool)
  for row in range(b):
    for i in range(n):
      parent = int(rng.integers(-1, i)) if i else -1
      if parent >= 0:
        mask[row, i] = mask[row, parent]
      mask[row, i, i] = True
  return mask


def _median_seconds(fn, args, iters: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bench_point(size: int, nodes: int, *, batch: int, heads: int, kv_heads: int, head_dim: int,
                dtype: str, iters: int, interpret: bool, seed: int = 0,
                impls: dict[str, Callable] | None = None) -> list[Row]:
  """The kernel, the reference and each of `impls` (in that order) on one (S, N) point."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, nodes, heads, head_dim)), dtype)
  k = jnp.asarray(rng.standard_normal((batch, size, kv_heads, head_dim)), dtype)
  v = jnp.asarray(rng.standard_normal((batch, size, kv_heads, head_dim)), dtype)
  length = jnp.full((batch,), size - nodes, jnp.int32)
  mask = jnp.asarray(random_tree_mask(rng, batch, nodes))
  args, scale = (q, k, v, length, mask), head_dim**-0.5
  nbytes, peak = kv_bytes_read(k, length, nodes), None if interpret else peak_bandwidth()
  extra = dict(impls or {})
  if extra.keys() & {"pallas", "reference"}:
    raise ValueError(f"'pallas' and 'reference' are always run; got extra impls {sorted(extra)}")
  fns = {
      "pallas": jax.jit(lambda *a: tree_attention(*a, sm_scale=scale, interpret=interpret)),
      "reference": jax.jit(lambda *a: tree_attention_reference(*a, sm_scale=scale)),
  }
  for name, fn in extra.items():  # bind `fn` now: a bare closure would see only the last one
    fns[name] = jax.jit(lambda *a, fn=fn: fn(*a, sm_scale=scale))
  out = np.asarray(fns["pallas"](*args), np.float32)
  ref = np.asarray(fns["reference"](*args), np.float32)
  err = float(np.abs(out - ref).max())
  ok = np.isfinite(out).all() and err <= TOLERANCE[dtype] * max(1.0, float(np.abs(ref).max()))
  rows = []
  for name, fn in fns.items():
    note = ("ok" if ok else "MISMATCH") if name == "pallas" else ""
    rows.append(Row(size, nodes, name, _median_seconds(fn, args, iters), nbytes, peak,
                    err if name == "pallas" else None, note))
  return rows


def run(sizes, nodes, *, batch=1, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16",
        iters=None, cpu_max_size=4096, seed=0,
        impls: dict[str, Callable] | None = None) -> list[Row]:
  """All (S, N) points; on CPU, points with S > cpu_max_size are listed as skipped.

  impls: name -> fn(q, k_cache, v_cache, length, tree_mask, *, sm_scale), timed beside the
  kernel and the reference (which are always run, the reference as the kernel's check).
  """
  interpret = jax.default_backend() not in ("gpu", "tpu")
  iters = iters or (2 if interpret else 20)
  rows = []
  for size in sizes:
    for n in nodes:
      if n > size:
        continue
      if interpret and size > cpu_max_size:
        rows.append(Row(size, n, "pallas", None, 0, None,
                        note=f"skipped: interpret mode on CPU above S={cpu_max_size}"))
        continue
      rows += bench_point(size, n, batch=batch, heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, dtype=dtype, iters=iters, interpret=interpret,
                          seed=seed, impls=impls)
  return rows


def format_table(rows: list[Row]) -> str:
  lines = [f"{'S':>6} {'N':>3}  {'impl':<9} {'time ms':>9} {'KV GB/s':>8} {'%peak':>6} "
           f"{'max err':>8}  check"]
  for r in rows:
    time_ms = f"{r.seconds * 1e3:9.3f}" if r.seconds else f"{'-':>9}"
    rate = f"{r.bytes_per_s / 1e9:8.3g}" if r.bytes_per_s else f"{'-':>8}"
    frac = f"{100 * r.bytes_per_s / r.peak:5.1f}%" if r.peak and r.bytes_per_s else f"{'-':>6}"
    err = f"{r.max_err:8.1e}" if r.max_err is not None else f"{'':>8}"
    lines.append(f"{r.size:>6} {r.nodes:>3}  {r.impl:<9} {time_ms} {rate} {frac} {err}  {r.note}")
  return "\n".join(lines)
