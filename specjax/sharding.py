"""Device meshes and partition rules: how params, KV caches and batches lie across devices.

A mesh has two axes, `data` (batch rows) and `model` (tensor parallelism), written as a spec
such as `"dp=2,tp=4"` (`-1`: every remaining device). Sharding is declared as data in two tables:

  * `PARAM_RULES`: an ordered table of regexes on parameter paths (`layers/0/self_attn/q_proj/
    kernel`, a drafter's `params/layer/q_proj/kernel`) -> *logical* axes per dimension (`vocab`,
    `heads`, `kv_heads`, `mlp`, or None). The first matching rule wins; a drafter family
    prepends its own (`partition_rules` on its pytree class).
  * `LOGICAL_AXES`: logical axis -> mesh axis (`batch` -> data; vocab, heads, kv_heads, mlp ->
    model), resolved per model config by `axis_map`.

Megatron-style tensor parallelism follows: q/k/v and gate/up projections are split by columns
(heads, MLP units), o/down projections by rows, embeddings and LM heads over the vocabulary,
norms replicated; the partitioner inserts one all-reduce after each row-parallel projection.

The KV-head rule (GQA/MQA): the cache (`[B, S, K, D]` per layer) and the k/v projections are
split over `model` when the model axis divides the K KV heads; otherwise they are *replicated* over
`model`, and each device computes and stores all K heads for its batch rows while its query
heads are split. Query heads, MLP units and the vocabulary of a target must divide the model
axis (`ShardingError` otherwise); a drafter's dimensions that do not divide are replicated
instead. The cache's batch rows are split over `data`; `generate` pads a batch to a multiple of
it.

Drafters are laid out beside their target by `place_drafter`: a whole copy on every device when
that at most doubles each device's parameter bytes, else split by the rules above
(`replicates_drafter`). A copied drafter also looks tokens up in a whole copy of the target's
embedding table (`with_whole_embedding`): a draft of a few small sublayers and lookups then runs
with few collectives.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
AUTO = "auto"  # the mesh spec of `auto_mesh`
_SPEC_NAMES = {"dp": DATA, "data": DATA, "tp": MODEL, "model": MODEL}

EMBEDDING = r"embed_tokens/embedding$"  # a target's input embedding table, by parameter path


class ModelShape(Protocol):
  """The sizes the partition rules read of a model: a `specjax.models.config.ModelConfig`, or any
  object with these fields. This module names them rather than importing the config class: the
  models import this module, so it lies below them."""

  num_heads: int
  num_kv_heads: int
  intermediate_size: int
  vocab_size: int
  hf_architecture: str  # named in errors


# (regex searched in the parameter path, logical axis per dimension). Order matters.
Rules = tuple[tuple[str, tuple[str | None, ...]], ...]

PARAM_RULES: Rules = (
    (EMBEDDING, ("vocab", None)),  # [V, E]; tied: also the LM head
    (r"lm_head/kernel$", (None, "vocab")),  # [E, V]
    (r"q_proj/kernel$", (None, "heads")),  # [E_in, H*D]
    (r"q_proj/bias$", ("heads",)),
    (r"(k_proj|v_proj)/kernel$", (None, "kv_heads")),  # [E_in, K*D]
    (r"(k_proj|v_proj)/bias$", ("kv_heads",)),
    (r"o_proj/kernel$", ("heads", None)),  # [H*D, E]: row-parallel
    (r"(gate_proj|up_proj)/kernel$", (None, "mlp")),  # [E, F]
    (r"(gate_proj|up_proj)/bias$", ("mlp",)),
    (r"down_proj/kernel$", ("mlp", None)),  # [F, E]: row-parallel
    (r"^head$", (None, "vocab")),  # a drafter's frozen copy of the target's head [E, Vd]
    (r".*", ()),  # norms, row-parallel biases, index tables: replicated
)

# A layer's KV cache [B, S, K, D]; queries [B, T, H, D] and new keys / values [B, T, K, D].
CACHE_AXES = ("batch", None, "kv_heads", None)
HEADS_AXES = ("batch", None, "heads", None)
KV_AXES = ("batch", None, "kv_heads", None)

LOGICAL_AXES = {"batch": DATA, "vocab": MODEL, "heads": MODEL, "kv_heads": MODEL, "mlp": MODEL}


class ShardingError(ValueError):
  """A mesh or a model that cannot be laid out as asked (the message names the problem)."""


# -- meshes ------------------------------------------------------------------------------------


def check_mesh_spec(spec: str) -> dict[str, int]:
  """The axis sizes `spec` names, {"data": 2, "model": -1} for "dp=2,tp=-1", its syntax checked
  (no device count needed): dp / data and tp / model, each a positive int or -1, once each."""
  if not isinstance(spec, str) or not spec.strip():
    raise ShardingError(f"mesh spec must be a string such as 'dp=2,tp=4', got {spec!r}")
  sizes: dict[str, int] = {}
  for item in spec.replace(" ", "").split(","):
    name, eq, value = item.partition("=")
    if not eq or name not in _SPEC_NAMES:
      raise ShardingError(f"mesh spec {spec!r}: {item!r} is not dp=N or tp=N (N an int or -1)")
    axis = _SPEC_NAMES[name]
    if axis in sizes:
      raise ShardingError(f"mesh spec {spec!r} names the {axis} axis twice")
    try:
      sizes[axis] = int(value)
    except ValueError:
      raise ShardingError(f"mesh spec {spec!r}: size {value!r} is not an int") from None
    if sizes[axis] == 0 or sizes[axis] < -1:
      raise ShardingError(f"mesh spec {spec!r}: axis sizes are positive ints or -1")
  if sum(n == -1 for n in sizes.values()) > 1:
    raise ShardingError(f"mesh spec {spec!r}: only one axis may be -1")
  return sizes


def spec_devices(spec: str) -> int | None:
  """The number of devices mesh spec `spec` needs, or None when an axis is -1 (any count)."""
  sizes = check_mesh_spec(spec)
  return None if -1 in sizes.values() else math.prod(sizes.values())


def parse_mesh_spec(spec: str, num_devices: int) -> dict[str, int]:
  """`"dp=2,tp=4"` -> {"data": 2, "model": 4}; one size may be -1 (the remaining devices); an
  axis left out has size 1. The sizes must multiply to `num_devices`."""
  sizes = check_mesh_spec(spec)
  free = [a for a, n in sizes.items() if n == -1]
  fixed = math.prod(n for n in sizes.values() if n != -1)
  if free:
    if num_devices % fixed:
      raise ShardingError(f"mesh spec {spec!r}: {num_devices} devices do not split into "
                          f"{fixed} x -1")
    sizes[free[0]] = num_devices // fixed
  out = {DATA: sizes.get(DATA, 1), MODEL: sizes.get(MODEL, 1)}
  if math.prod(out.values()) != num_devices:
    need = math.prod(out.values())
    hint = (_cpu_hint() if need > num_devices else
            f"; to use them all, make one axis -1 (e.g. dp=-1,tp={out[MODEL]})")
    raise ShardingError(f"mesh spec {spec!r} needs {need} devices, but {num_devices} are "
                        f"available{hint}")
  return out


def _cpu_hint() -> str:
  """How to get more devices on a CPU host, where JAX starts with one unless told."""
  if jax.default_backend() != "cpu":
    return ""
  return ("; on a CPU, JAX has as many devices as it is given before it starts: an "
          "experiment given the spec (--set mesh=..., --mesh) starts with them, unless "
          "--cpu-devices or the environment says otherwise; in Python, call "
          "specjax.distributed.initialize(cpu_devices=N) first thing, or set "
          "JAX_NUM_CPU_DEVICES=N")


def make_mesh(spec: str | Mesh | None = None, *, devices: Sequence[Any] | None = None) -> Mesh:
  """The (data, model) mesh of `spec` over `devices` (default: every device of every process).

  None is all devices on `data`; a Mesh is returned as it is (its axes must be data and model).
  Axes are `AxisType.Auto`: the partitioner propagates the declared shardings through the
  program, so the model code is the same on one device and on a mesh.
  """
  if isinstance(spec, Mesh):
    if set(spec.axis_names) != {DATA, MODEL}:
      raise ShardingError(f"a specjax mesh has axes ('data', 'model'), got {spec.axis_names}")
    return spec
  devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh_spec("dp=-1" if spec is None else spec, len(devices))
  return jax.make_mesh((sizes[DATA], sizes[MODEL]), (DATA, MODEL),
                       axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def host_cores() -> int:
  """The cores this process may run on (its CPU affinity)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_mesh(cfg: ModelShape, devices: Sequence[Any] | None = None) -> Mesh | None:
  """The mesh of `mesh="auto"`: tensor parallelism (dp=1) over as many of `devices` (default:
  every device) as `cfg`'s heads, MLP units and vocabulary allow, or None when that is one.

  On a CPU the devices are cores (`cpu_devices="auto"` makes one per core, `distributed`): a
  single-device program leaves all but one core idle at batch 1, since XLA splits a decode step's
  small matmuls across no threads. Emulated CPU devices beyond the cores would only share them, so
  at most `host_cores()` of them count. dp stays 1 (every device works on the same rows, as a
  batch of one needs); name a mesh such as `dp=2,tp=2` for batches.
  """
  devices = list(jax.devices() if devices is None else devices)
  if devices and devices[0].platform == "cpu" and jax.process_count() == 1:
    devices = devices[:host_cores()]
  for tp in range(len(devices), 1, -1):
    mesh = make_mesh(f"dp=1,tp={tp}", devices=devices[:tp])
    try:
      axis_map(cfg, mesh, strict=True)
    except ShardingError:
      continue
    return mesh
  return None


def model_mesh(spec: str | Mesh | None, cfg: ModelShape) -> Mesh | None:
  """The mesh a model of `cfg` is placed on for `spec`: "auto" (`auto_mesh`: None where it
  finds one device), else `make_mesh(spec)`."""
  if isinstance(spec, str) and spec.strip() == AUTO:
    return auto_mesh(cfg)
  return make_mesh(spec)


def mesh_spec(mesh: Mesh) -> str:
  """The spec string of a mesh, e.g. 'dp=2,tp=4'."""
  return f"dp={mesh.shape[DATA]},tp={mesh.shape[MODEL]}"


def data_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape[DATA]


def model_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape[MODEL]


# -- logical axes -> mesh axes -----------------------------------------------------------------


def axis_map(cfg: ModelShape | None, mesh: Mesh, *, strict: bool) -> dict[str, str | None]:
  """Logical axis -> mesh axis for a model of `cfg` on `mesh`.

  `kv_heads` falls back to replicated when the model axis does not divide the KV heads (the
  KV-head rule). For `strict` (a target), query heads, MLP units and vocabulary that the model
  axis does not divide raise ShardingError; otherwise they are replicated too.
  """
  tp = model_size(mesh)
  amap = dict(LOGICAL_AXES)
  if cfg is None or tp == 1:
    return amap
  if cfg.num_kv_heads % tp:
    amap["kv_heads"] = None
  checks = {"heads": ("num_attention_heads", cfg.num_heads),
            "mlp": ("intermediate_size", cfg.intermediate_size),
            "vocab": ("vocab_size", cfg.vocab_size)}
  for axis, (field, n) in checks.items():
    if n % tp:
      if strict:
        raise ShardingError(f"{field} {n} of this {cfg.hf_architecture} is not divisible by "
                            f"the model axis ({tp}): use a mesh whose tp divides {n}")
      amap[axis] = None
  if amap["heads"] is not None and amap["kv_heads"] is None and tp % cfg.num_kv_heads:
    # Each device's query heads must fall inside one KV group (split or replicated cleanly).
    if strict:
      raise ShardingError(f"{cfg.num_kv_heads} KV heads neither divide nor are divided by the "
                          f"model axis ({tp}): use a tp that is a multiple or a divisor of "
                          f"{cfg.num_kv_heads}")
    amap["heads"] = None
  return amap


def _key_name(k) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_str(path: tuple) -> str:
  """A pytree key path as `a/b/0/c` (nnx Variables' `.value` / `.raw_value` dropped)."""
  names = [_key_name(k) for k in path]
  while names and names[-1] in ("value", "raw_value"):
    names.pop()
  return "/".join(names)


def _spec_for(path: str, shape: tuple[int, ...], rules: Rules, amap: dict[str, str | None],
              mesh: Mesh, strict: bool, what: str) -> PartitionSpec:
  logical = next((axes for pattern, axes in rules if re.search(pattern, path)), ())
  if len(logical) > len(shape):
    logical = ()  # a rule written for another rank (e.g. a scalar): replicate
  axes: list[str | None] = []
  for dim, name in zip(shape, logical):
    axis = amap.get(name) if name else None
    if axis is not None and dim % mesh.shape[axis]:
      if strict:
        raise ShardingError(f"{what} {path}: dimension of size {dim} ({name}) is not divisible "
                            f"by the {axis} axis ({mesh.shape[axis]})")
      axis = None
    axes.append(axis)
  return PartitionSpec(*axes)


def partition_specs(tree: Any, rules: Rules, amap: dict[str, str | None], mesh: Mesh, *,
                    strict: bool = False, what: str = "parameter") -> Any:
  """The PartitionSpec of every array leaf of `tree` (arrays or ShapeDtypeStructs) under
  `rules`; non-array leaves (None) stay as they are."""
  def one(path, leaf):
    if not hasattr(leaf, "shape"):
      return None
    return _spec_for(path_str(path), tuple(leaf.shape), rules, amap, mesh, strict, what)
  return jax.tree_util.tree_map_with_path(one, tree)


def shardings(tree: Any, rules: Rules, amap: dict[str, str | None], mesh: Mesh, *,
              strict: bool = False, what: str = "parameter") -> Any:
  """`partition_specs` as NamedShardings on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s),
                      partition_specs(tree, rules, amap, mesh, strict=strict, what=what),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def place(tree: Any, tree_shardings: Any) -> Any:
  """`jax.device_put` leaf by leaf (a leaf already laid out so is not copied). Onto a sharding
  that spans other processes, each process builds its own shards from its (identical) copy."""
  def one(x, s):
    if s is None or (isinstance(x, jax.Array) and x.sharding == s):
      return x
    if s.is_fully_addressable:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda index: host[index])
  return jax.tree.map(one, tree, tree_shardings, is_leaf=lambda x: x is None)


# -- what a target, a drafter and a cache get --------------------------------------------------


def param_shardings(cfg: ModelShape, params: Any, mesh: Mesh) -> Any:
  """NamedShardings of a target's params (strict: a target must split as the rules say)."""
  return shardings(params, PARAM_RULES, axis_map(cfg, mesh, strict=True), mesh, strict=True)


def drafter_rules(drafter: Any) -> Rules:
  """A drafter family's own rules (its class's `partition_rules`), then the common table."""
  return tuple(getattr(drafter, "partition_rules", ())) + PARAM_RULES


def drafter_shardings(drafter: Any, target_cfg: ModelShape, mesh: Mesh) -> Any:
  """NamedShardings of a drafter pytree's array leaves. Dimensions are resolved against the
  drafter's own network config (`partition_config`, e.g. a draft LM's) or the target's, and
  whatever does not divide is replicated."""
  cfg = getattr(drafter, "partition_config", None) or target_cfg
  return shardings(drafter, drafter_rules(drafter), axis_map(cfg, mesh, strict=False), mesh,
                   what="drafter leaf")


def shard_drafter(drafter: Any, target_cfg: ModelShape, mesh: Mesh) -> Any:
  """The drafter with its arrays split on `mesh` by its rules (a no-op for one already placed)."""
  return place(drafter, drafter_shardings(drafter, target_cfg, mesh))


def nbytes(tree: Any) -> int:
  """Bytes of the (global) arrays in `tree`, counted once whatever their layout."""
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _is_embedding(path: tuple) -> bool:
  return re.search(EMBEDDING, path_str(path)) is not None


def embedding_tables(target_params: Any) -> list[Any]:
  """The target's input embedding table as a list of its one leaf (empty for params without
  one)."""
  return [x for path, x in jax.tree_util.tree_flatten_with_path(target_params)[0]
          if _is_embedding(path)]


def embedding_bytes(target_params: Any) -> int:
  """Bytes of the target's input embedding table (0 for params without one)."""
  return nbytes(embedding_tables(target_params))


def replicates_drafter(drafter: Any, target_params: Any, mesh: Mesh | None) -> bool:
  """Whether `place_drafter` puts a whole copy of the drafter on every device of the model axis
  instead of splitting it, and the decoding loop gives it a whole copy of the target's embedding
  table to look tokens up in (`with_whole_embedding`).

  A drafter is a layer or two run on a handful of rows: split over `model`, each of its
  sublayers ends in a collective that its few FLOPs do not pay for, and so does each lookup of a
  token in the vocabulary-split table; a draft is a sequence of such steps. Copies are made when
  they at most double the parameter bytes each device holds (the target's share plus the
  drafter's): drafter bytes x (tp - 2) + table bytes x (tp - 1) <= target bytes. The bound keeps
  a drafter that is big beside a device's share of the target (a draft LM over many devices, say)
  split. The target's verification stays split either way."""
  tp = model_size(mesh)
  return tp > 1 and (nbytes(drafter) * (tp - 2) + embedding_bytes(target_params) * (tp - 1)
                     <= nbytes(target_params))


def place_drafter(drafter: Any, target: Any, mesh: Mesh, *, copied: bool | None = None) -> Any:
  """The drafter laid out beside `target` (its `config` and `params`) on `mesh`: replicated
  when `replicates_drafter` says so (`copied`: its answer, when the caller has it already), else
  split by its rules (`shard_drafter`). A no-op for a drafter already laid out so."""
  if copied is None:
    copied = replicates_drafter(drafter, target.params, mesh)
  if not copied:
    return shard_drafter(drafter, target.config, mesh)
  rep = replicated(mesh)
  return place(drafter, jax.tree.map(lambda _: rep, drafter))


def with_whole_embedding(target_params: Any) -> Any:
  """The target's params as a copied drafter reads them, traced under the mesh: the embedding
  table gathered whole onto every device (once per program, where this is called), so a lookup
  needs no collective; every other array as it is laid out."""
  mesh = tracing_mesh()
  if mesh is None:
    return target_params
  whole = NamedSharding(mesh, PartitionSpec())

  def one(path, x):
    return jax.lax.with_sharding_constraint(x, whole) if _is_embedding(path) else x
  return jax.tree_util.tree_map_with_path(one, target_params)


def logical_spec(logical: tuple[str | None, ...], amap: dict[str, str | None]) -> PartitionSpec:
  return PartitionSpec(*(amap.get(n) if n else None for n in logical))


def tracing_mesh():
  """The (data, model) mesh being traced under (`jax.set_mesh`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or set(mesh.axis_names) != {DATA, MODEL} else mesh


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
  """Pins `x`'s layout to logical axes per dimension when traced under a (data, model) mesh
  (`jax.set_mesh`, as `generate` traces); a no-op otherwise. A dimension that its mesh axis does
  not divide stays whole (e.g. KV heads: the KV-head rule).

  Model code marks the few places where the partitioner's own choice would be costly: without
  them it may split a replicated KV cache along a sub-axis to match the query heads' split and
  gather it back every layer."""
  mesh = tracing_mesh()
  if mesh is None:
    return x
  axes = []
  for dim, name in zip(x.shape, logical):
    axis = LOGICAL_AXES.get(name) if name else None
    axes.append(axis if axis is not None and dim % mesh.shape[axis] == 0 else None)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*axes)))


def cache_spec(cfg: ModelShape, mesh: Mesh) -> PartitionSpec:
  """A layer's cache [B, S, K, D]: rows over data, KV heads over model (or replicated: the
  KV-head rule)."""
  return logical_spec(CACHE_AXES, axis_map(cfg, mesh, strict=False))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension over `data`, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def padded_batch(batch: int, mesh: Mesh | None) -> int:
  """The smallest multiple of the data axis that holds `batch` rows."""
  dp = data_size(mesh)
  return -(-batch // dp) * dp


# -- building arrays from host data without a full copy per device ----------------------------


def from_host_slices(shape: tuple[int, ...], dtype, sharding: NamedSharding,
                     read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """A global array of `shape` laid out by `sharding`, each addressable shard built from
  `read(index)` (e.g. a slice read from a safetensors file): no device, and no host, ever holds
  more of the tensor than its shards. In a multi-process run each process reads only its own."""
  def shard(index):
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return np.asarray(read(index)).astype(dtype, copy=False)
  return jax.make_array_from_callback(shape, sharding, shard)


def bytes_per_device(tree: Any) -> dict[int, int]:
  """Bytes each device (by id) holds of the arrays in `tree` (addressable shards only)."""
  out: dict[int, int] = {}
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      for s in leaf.addressable_shards:
        out[s.device.id] = out.get(s.device.id, 0) + int(s.data.nbytes)
  return out


def describe(mesh: Mesh | None) -> str:
  """One line: the mesh spec and its devices' platform, e.g. 'dp=2,tp=4 over 8 cpu devices'."""
  if mesh is None:
    return f"1 {jax.devices()[0].platform} device"
  return f"{mesh_spec(mesh)} over {mesh.size} {mesh.devices.flat[0].platform} devices"
