"""Medusa-1 heads in the layout of their authors (FasterDecoding/Medusa) -> the `medusa` family.

config.json (Medusa's `MedusaConfig`; absent on some old heads, then read from the tensors):
`medusa_num_heads` K, `medusa_num_layers` L, `base_model_name_or_path`.

Weights: `medusa_lm_head.safetensors` or `medusa_lm_head.pt` (a pickled torch state dict, read
only through torch), the state dict of a `ModuleList` of K heads, each
`Sequential(*([ResBlock(H)] * L), Linear(H, V, bias=False))` (torch layout, [out, in]):

  {i}.{j}.linear.weight    [H, H]   j < L: the ResBlock x + SiLU(linear(x))
  {i}.{j}.linear.bias      [H]
  {i}.{L}.weight           [V, H]   head i's own LM head over the full vocabulary

Full Medusa-2 checkpoints hold the same tensors under `medusa_head.`; their other tensors (the
base model's) are not read: the target is the one the drafter is loaded for.

`[ResBlock(H)] * L` repeats one module object, so a head's L layers share their weights; its
state dict still names every j, each with the same tensors. They are read, checked equal (a
checkpoint whose layers differ is refused: it is not this module) and the one block applied L
times (`MedusaConfig.num_layers`). The heads read the target's final normed hidden state
(specjax's index L, the LM head's input); the draft vocabulary is the target's whole vocabulary
(d2t = arange(V)) and each head keeps its own LM head (`MedusaConfig.own_heads`).

The authors' code ignores an uploaded config's head count on its legacy path (their configs
named fewer heads than the weights hold): the heads the tensors hold are read, and a config that
names fewer is recorded in the drafter's `source`; one that names more, or another L, is refused.

Writing: `medusa_lm_head.safetensors` (the shared block under every j, as the state dict names
it) and config.json, whose `base_model_name_or_path` is null (specjax does not know where its
target came from). Drafters that read another hidden state than the final normed one are
refused. specjax's Medusa drafters that draft through the target's LM head are written with that
head as every head's own, which needs the draft vocabulary to be the whole target vocabulary
(a smaller one is refused: the published heads cover every id).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from specjax.drafters import format_common as common
from specjax.drafters import formats, learned, static_tree
from specjax.drafters.medusa import MedusaConfig, MedusaHeads

WEIGHTS = "medusa_lm_head.safetensors"
PICKLE = "medusa_lm_head.pt"
PREFIX = "medusa_head."
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _heads_of(names, prefix: str) -> dict[int, dict[int, set[str]]]:
  """head i -> module index j -> tensor kinds, of the names under `prefix`."""
  heads: dict[int, dict[int, set[str]]] = {}
  for name in names:
    if name.startswith(prefix) and (m := _KEY.match(name[len(prefix):])):
      heads.setdefault(int(m[1]), {}).setdefault(int(m[2]), set()).add(m[3])
  return heads


def _prefix_of(names) -> str:
  return PREFIX if any(n.startswith(PREFIX) for n in names) else ""


def shape_of(ckpt: common.Checkpoint, prefix: str, where: str) -> tuple[int, int]:
  """(K heads, L layers) the checkpoint holds, its structure checked: heads
  0..K-1, each L ResBlocks (weight and bias) then its LM head, nothing else."""
  names = ckpt.names()
  heads = _heads_of(names, prefix)
  if not heads:
    raise ValueError(f"{where}: no Medusa head tensors ({prefix}{{i}}.{{j}}.linear.weight)")
  k = max(heads) + 1
  missing = [i for i in range(k) if i not in heads]
  if missing:
    raise ValueError(f"{where}: heads {missing} are missing (the tensors name heads up to {k - 1})")
  layers = {i: max(mods) for i, mods in heads.items()}  # j of each head's LM head
  if len(set(layers.values())) != 1:
    raise ValueError(f"{where}: the heads have different numbers of layers {layers}")
  n = layers[0]
  want = {j: {"linear.weight", "linear.bias"} for j in range(n)} | {n: {"weight"}}
  for i in range(k):
    for j in range(n + 1):
      gone = sorted(want[j] - heads[i].get(j, set()))
      extra = sorted(heads[i].get(j, set()) - want[j])
      if gone:
        raise ValueError(f"{where}: head {i} lacks {[f'{prefix}{i}.{j}.{t}' for t in gone]} "
                         f"(a head is {n} ResBlocks, linear weight and bias, then its LM head "
                         f"{prefix}{i}.{n}.weight)")
      if extra:
        raise ValueError(f"{where}: unexpected tensors "
                         f"{[f'{prefix}{i}.{j}.{t}' for t in extra]}")
  return k, n


def check_config(config: dict[str, Any] | None, k: int, n: int, where: str
                 ) -> dict[str, Any]:
  """What the config.json says against the tensors (see the module docstring), for `source`."""
  if config is None:
    return {"config": "none: heads and layers read from the tensors"}
  note: dict[str, Any] = {"base_model_name_or_path": config.get("base_model_name_or_path")}
  heads, layers = config.get("medusa_num_heads"), config.get("medusa_num_layers")
  if heads is not None and int(heads) > k:
    raise ValueError(f"{where}: config.json names medusa_num_heads {heads}, the tensors hold "
                     f"{k} heads")
  if heads is not None and int(heads) < k:
    note["config_heads"] = (f"config.json names {heads} heads, the tensors hold {k}: all {k} "
                            "are read (as the authors' loader does)")
  if layers is not None and int(layers) != n:
    raise ValueError(f"{where}: config.json names medusa_num_layers {layers}, the tensors hold "
                     f"{n} ResBlocks per head")
  return note


def read_params(ckpt: common.Checkpoint, net: MedusaConfig, prefix: str) -> Any:
  """Our stacked params ([K, E, E] kernels, [K, E] biases, [K, E, V] LM heads) from the heads'
  tensors; every shared layer read and checked equal to the head's first."""
  e, k, n, v = net.hidden_size, net.num_heads, net.num_layers, net.draft_vocab_size

  def block(i: int, kind: str, shape) -> np.ndarray:
    first = ckpt.get(f"{prefix}{i}.0.linear.{kind}", shape)
    for j in range(1, n):
      other = ckpt.get(f"{prefix}{i}.{j}.linear.{kind}", shape)
      if not np.array_equal(first, other):
        raise ValueError(
            f"{ckpt.path}: head {i}'s layers differ ({prefix}{i}.0.linear.{kind} != "
            f"{prefix}{i}.{j}.linear.{kind}): Medusa's [ResBlock(H)] * L shares one block per "
            "head, so this is not a Medusa checkpoint of that module")
    return first

  def read(name, shape):
    if name == "weight":
      return np.stack([block(i, "weight", (e, e)).T for i in range(k)])
    if name == "bias":
      return np.stack([block(i, "bias", (e,)) for i in range(k)])
    if name == "lm_head":
      return np.stack([ckpt.get(f"{prefix}{i}.{n}.weight", (v, e)).T for i in range(k)])
    raise AssertionError(f"no Medusa tensor for {name}")

  return common.fill_params(learned.abstract_params(MedusaHeads, net), read)


def default_tree(num_heads: int) -> dict[str, Any]:
  """specjax's static-tree default; cut to the paths `num_heads` heads can draft."""
  if max(map(len, static_tree.DEFAULT_CHOICES)) <= num_heads:
    return {}
  return {"choices": tuple(p for p in static_tree.DEFAULT_CHOICES if len(p) <= num_heads)}


class MedusaFormat(formats.Format):
  name = "medusa"
  method = "medusa"
  weight_names = (WEIGHTS, PICKLE)

  def matches(self, config, tensors) -> bool:
    if config is not None and "medusa_num_heads" in config and tensors:
      return True
    prefix = _prefix_of(tensors)
    return any(t.startswith(prefix) and _KEY.match(t[len(prefix):]) for t in tensors)

  def read(self, ckpt, target):
    cfg, where = target.config, ckpt.path
    prefix = _prefix_of(ckpt.names())
    k, n = shape_of(ckpt, prefix, where)
    if n < 1:
      raise ValueError(f"{where}: heads without a ResBlock (medusa_num_layers 0) are not "
                       "supported")
    note = check_config(ckpt.config, k, n, where)
    w = ckpt.shapes[f"{prefix}0.0.linear.weight"]
    if w[0] != cfg.hidden_size:
      raise ValueError(f"{where}: the heads are {w[0]} wide ({prefix}0.0.linear.weight {w}), "
                       f"the target's hidden size is {cfg.hidden_size}: they were made for "
                       "another target")
    head = ckpt.shapes[f"{prefix}0.{n}.weight"]
    common.check_vocab(f"{prefix}0.{n}.weight", head[0], cfg, where)
    net = MedusaConfig(cfg.hidden_size, k, num_layers=n, own_heads=True,
                       draft_vocab_size=cfg.vocab_size)
    params = read_params(ckpt, net, prefix)
    # A full Medusa-2 checkpoint: the base model's tensors are not the drafter's.
    ckpt.check_all_used([t for t in ckpt.names() if prefix and not t.startswith(prefix)])
    source = {"format": self.name, "files": ckpt.files, "prefix": prefix,
              "input": f"the target's final normed hidden state (index {cfg.num_layers})",
              "shared_layers": f"{n} applications of each head's one ResBlock", **note}
    return common.Converted(self.method, net, params, np.arange(cfg.vocab_size, dtype=np.int32),
                            (cfg.num_layers,), default_tree(k), source)

  def write(self, path, drafter, target, dtype=None):
    target_cfg = target.config
    net = drafter.net
    v, e = target_cfg.vocab_size, target_cfg.hidden_size
    if tuple(drafter.hidden_layers) != (target_cfg.num_layers,):
      raise ValueError(f"the Medusa layout's heads read the final normed state (hidden layer "
                       f"{target_cfg.num_layers}); this drafter reads {drafter.hidden_layers}")
    d2t = np.asarray(drafter.d2t)
    if d2t.size != v or not np.array_equal(np.sort(d2t), np.arange(v)):
      raise ValueError(f"the Medusa layout's heads cover the whole vocabulary ({v} ids); this "
                       f"drafter's draft vocabulary has {d2t.size}: its LM heads cannot be "
                       "written over the full vocabulary")
    flat = common.flat_params(drafter.params)
    if net.own_heads:
      heads = [flat["lm_head"][i] for i in range(net.num_heads)]  # [E, Vd] each
    else:
      heads = [np.asarray(drafter.head, np.float32)] * net.num_heads  # the target's, [E, Vd]
    tensors = {}
    for i in range(net.num_heads):
      for j in range(net.num_layers):  # the one shared block under every index, as torch saves
        tensors[f"{i}.{j}.linear.weight"] = flat["weight"][i].T
        tensors[f"{i}.{j}.linear.bias"] = flat["bias"][i]
      full = np.zeros((v, e), np.float32)
      full[d2t] = heads[i].T  # draft id -> its target id's row
      tensors[f"{i}.{net.num_layers}.weight"] = full
    common.write_weights(path, tensors, dtype, WEIGHTS)
    common.write_json(path, common.CONFIG, {
        "medusa_num_heads": net.num_heads, "medusa_num_layers": net.num_layers,
        "base_model_name_or_path": None})


formats.register(MedusaFormat())
