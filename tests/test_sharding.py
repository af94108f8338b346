"""Decoding on a device mesh: the same tokens on every mesh, with the layout the rules declare.

The session has 8 CPU devices (tests/conftest.py). What is checked:
  1. mesh specs and the rules: parsing, the KV-head rule, clear errors for what cannot split;
  2. placement is real: each device holds 1/tp of every split weight (its addressable shards)
     and 1/dp of the cache rows, also when loaded straight from safetensors onto a mesh; the
     compiled decode program gathers no weight matrix and no KV cache, and every method's
     program orders each loop that communicates against its other collectives (`hlo.races`);
  3. greedy output on dp=1/tp=8, dp=2/tp=4, dp=4/tp=2 and dp=8/tp=1 equals one device's, for
     autoregressive decoding and every registered drafter family, at batch 1, 4 and 8 with
     unequal prompt lengths (float32), on a tiny target and on the embedded default with its
     trained drafters; sampled output with a fixed seed is identical across meshes; the Pallas
     attention gives the same tokens per device under shard_map.

Compile time dominates on CPU: each (drafter, mesh, batch) is one program, so the full matrix
runs on a tiny two-layer target, batch sizes share programs where padding makes them equal, and
the embedded default runs its trained drafters at batch 8 on the two meshes that exercise both
halves of the KV-head rule.
"""

from __future__ import annotations

import collections
import os
import re

import jax
import numpy as np
import pytest

import specjax
from specjax import assets, decoding, drafters, rounds, sharding
from specjax.children import Children
from specjax.drafters import draft_lm
from specjax.drafters.io import load_drafter
from specjax.interop.hf import load_target
from specjax.lab import hlo, phases, profiling
from tests.helpers import tiny_targets as tt

MESHES = ("dp=1,tp=8", "dp=2,tp=4", "dp=4,tp=2", "dp=8,tp=1")
NEW = 24
# Past one prefill chunk (decoding.PREFILL_CHUNK): the programs run the prefill's chunk loop.
PAD = 128


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
  """n prompts of unequal lengths (5..30), half of them a repeated motif (prompt lookup and
  token recycling then draft something)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    length = int(rng.integers(5, 31))
    if i % 2:
      motif = rng.integers(0, vocab, int(rng.integers(2, 6))).tolist()
      out.append((motif * 16)[:length])
    else:
      out.append(rng.integers(0, vocab, length).tolist())
  return out


PROMPTS = _prompts(8, tt.GREEDY_VOCAB, seed=7)


# -- 1. specs and rules --------------------------------------------------------------------------


@pytest.mark.parametrize("spec, sizes", [
    ("dp=2,tp=4", {"data": 2, "model": 4}), ("tp=8", {"data": 1, "model": 8}),
    ("dp=-1,tp=2", {"data": 4, "model": 2}), ("data=8", {"data": 8, "model": 1}),
    ("dp=2, tp=-1", {"data": 2, "model": 4})])
def test_mesh_spec_parses(spec, sizes):
  assert sharding.parse_mesh_spec(spec, 8) == sizes
  mesh = sharding.make_mesh(spec)
  assert dict(mesh.shape) == sizes and sharding.mesh_spec(mesh) == (
      f"dp={sizes['data']},tp={sizes['model']}")


@pytest.mark.parametrize("spec, message", [
    ("dp=2,tp=2", "needs 4 devices, but 8 are available"),
    ("dp=3,tp=-1", "do not split"),
    ("dp=-1,tp=-1", "only one axis may be -1"),
    ("pp=2", "is not dp=N or tp=N"),
    ("dp=two", "is not an int"),
    ("dp=2,dp=4", "names the data axis twice"),
    ("", "must be a string")])
def test_bad_mesh_spec_is_rejected(spec, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(spec)


def test_kv_head_rule():
  """2 KV heads: split over a model axis of 2, replicated over 4 and 8 (the query heads split)."""
  cfg = tt.MESH_CONFIG
  for spec, kv in (("dp=4,tp=2", "model"), ("dp=2,tp=4", None), ("dp=1,tp=8", None)):
    mesh = sharding.make_mesh(spec)
    amap = sharding.axis_map(cfg, mesh, strict=True)
    assert amap["kv_heads"] == kv and amap["heads"] == "model"
    assert sharding.cache_spec(cfg, mesh) == jax.sharding.PartitionSpec("data", None, kv, None)


def test_target_whose_heads_do_not_divide_is_rejected():
  target = tt.greedy_target()  # 2 query heads
  with pytest.raises(ValueError, match="num_attention_heads 2 .* not divisible by the model "
                                       r"axis \(4\)"):
    target.on_mesh("dp=2,tp=4")
  with pytest.raises(ValueError, match="num_attention_heads 2"):
    specjax.generate(target, [[1, 2, 3]], max_new_tokens=2, mesh="dp=1,tp=8")


def test_kv_heads_neither_dividing_nor_divided_are_rejected():
  cfg = tt.config(48, hidden_size=48, num_heads=6, num_kv_heads=3)  # tp=2: 3 % 2, 2 % 3
  with pytest.raises(ValueError, match="3 KV heads neither divide nor are divided"):
    sharding.axis_map(cfg.replace(intermediate_size=96), sharding.make_mesh("dp=4,tp=2"),
                      strict=True)


def test_drafter_dims_that_do_not_divide_are_replicated():
  """A draft LM of 2 query heads on tp=4: its attention is replicated, its MLP still split."""
  target = tt.mesh_target().on_mesh("dp=2,tp=4")
  drafter = draft_lm.build(target, draft=tt.draft_target(), num_tokens=3)
  drafter = sharding.shard_drafter(drafter, target.config, target.mesh)
  specs = {sharding.path_str(p): x.sharding.spec
           for p, x in jax.tree_util.tree_leaves_with_path(drafter)}
  assert specs["params/layers/0/self_attn/q_proj/kernel"] == jax.sharding.PartitionSpec(
      None, None)
  assert specs["params/layers/0/mlp/up_proj/kernel"] == jax.sharding.PartitionSpec(None, "model")


# -- 2. placement --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded():
  return load_target(assets.TARGET_DIR)


def _shard_fraction(x: jax.Array) -> set[float]:
  return {s.data.size / x.size for s in x.addressable_shards}


@pytest.mark.parametrize("spec", ["dp=2,tp=4", "dp=4,tp=2"])
def test_placement_is_real(embedded, spec):
  """Loaded straight onto the mesh from safetensors: every weight a rule splits is held 1/tp per
  device (and equals the single-device load), norms whole; the cache rows 1/dp per device and its
  KV heads split or whole by the KV-head rule."""
  target = load_target(assets.TARGET_DIR, mesh=spec)
  mesh = target.mesh
  tp, dp = mesh.shape["model"], mesh.shape["data"]
  split = 0
  for (path, x), ref in zip(jax.tree_util.tree_leaves_with_path(target.params),
                            jax.tree.leaves(embedded.params)):
    name = sharding.path_str(path)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(ref), err_msg=name)
    if name.endswith("norm/weight"):
      assert x.sharding.is_fully_replicated, name
    elif "k_proj" in name or "v_proj" in name:
      assert _shard_fraction(x) == {1 / tp if target.config.num_kv_heads % tp == 0 else 1}
    else:
      assert _shard_fraction(x) == {1 / tp}, name
      split += 1
  assert split == 1 + 5 * target.config.num_layers  # embedding + q, o, gate, up, down per layer
  cache = decoding.prepare(target, [[1, 2, 3]] * 8, 4, decoding.NoDrafter(),
                           decoding.SamplingConfig()).fresh_cache()
  kv_split = target.config.num_kv_heads % tp == 0
  for shard in (s for layer in cache.k for s in layer.addressable_shards):
    b, _, k, _ = shard.data.shape
    assert b == 8 // dp and k == (target.config.num_kv_heads // tp if kv_split else
                                  target.config.num_kv_heads)
  per_device = sharding.bytes_per_device(target.params)
  whole = sharding.bytes_per_device(embedded.params)[0]
  assert len(per_device) == 8 and max(per_device.values()) < 1.1 * whole / tp


@pytest.mark.parametrize("spec, copied", [("dp=4,tp=2", True), ("dp=2,tp=4", False),
                                           ("dp=8,tp=1", False)])
def test_drafter_placement_follows_its_size(embedded, spec, copied):
  """The shipped DFlash (float32 beside the bfloat16-stored target: 9.4 MiB against 12.6 MiB,
  4 MiB of it the embedding table) is copied whole onto every device, with the table, where that
  at most doubles each device's parameter bytes (tp=2: 4 <= 12.6), and split by its rules where
  it would not (tp=4: 9.4 x 2 + 4 x 3 > 12.6); with no model axis
  there is nothing to split. The same layout whichever way it is built: by the registry, loaded
  from its folder, or placed by generate."""
  target = embedded.on_mesh(spec)
  tp = target.mesh.shape["model"]
  built = drafters.build("dflash", target)
  assert sharding.replicates_drafter(built, target.params, target.mesh) == copied
  leaves = [x for x in jax.tree.leaves(built) if isinstance(x, jax.Array)]
  assert leaves
  if copied:
    assert all(x.sharding.is_fully_replicated for x in leaves)
    per_device = sharding.bytes_per_device(built)
    assert set(per_device.values()) == {sharding.nbytes(built)}
  elif tp > 1:
    assert any(_shard_fraction(x) == {1 / tp} for x in leaves)
    split = sharding.shard_drafter(built, target.config, target.mesh)
    assert [x.sharding for x in leaves] == [
        x.sharding for x in jax.tree.leaves(split) if isinstance(x, jax.Array)]
  loaded = load_drafter(os.path.join(assets.ASSETS_DIR, "dflash"), target)
  placed = sharding.place_drafter(drafters.build("dflash", embedded), target, target.mesh)
  for other in (loaded, placed):
    assert [x.sharding for x in jax.tree.leaves(other) if isinstance(x, jax.Array)] == [
        x.sharding for x in leaves]


def _collectives(hlo: str) -> collections.Counter:
  """(named scope, collective kind, the jax op it serves) -> count over a compiled program's
  instructions (the op from their metadata: `gather` for a table lookup)."""
  scopes = profiling.hlo_scopes(hlo)
  found = collections.Counter()
  for name, kind, rest in re.findall(
      r"^\s*(?:ROOT )?%?([^\s=]+) = \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|"
      r"collective-permute)(?:-start)?\((.*)$", hlo, flags=re.M):
    op = re.search(r'op_name="([^"]*)"', rest)
    found[(scopes.get(name, "?"), kind, op.group(1).rsplit("/", 1)[-1] if op else "?")] += 1
  return found


@pytest.mark.parametrize("name", ["eagle", "eagle3", "dflash"])
def test_copied_drafters_look_tokens_up_without_collectives(embedded, name):
  """On dp=4,tp=2 the shipped drafters are copied whole onto each device and look tokens up in a
  whole copy of the target's embedding table, gathered once before the loop: no lookup in their
  draft phase or their update communicates (from the vocabulary-split table each was an
  all-reduce: 13 in EAGLE's and DFlash's compiled program, 9 in EAGLE-3's), while the target's
  verification stays split over `model` (its row-parallel all-reduces remain)."""
  target = embedded.on_mesh("dp=4,tp=2")
  drafter = drafters.build(name, target)
  assert sharding.replicates_drafter(drafter, target.params, target.mesh)
  prompts = [embedded.encode(t) for t in _CODE[:4]]
  _, hlo = phases.round_loop(target, prompts, drafter=drafter, max_new_tokens=NEW)
  assert any(s.startswith("draft/") for s in profiling.hlo_scopes(hlo).values())  # premise
  found = _collectives(hlo)
  lookups = {k: n for k, n in found.items() if k[2] == "gather"
             and (k[0].startswith("draft/") or "drafter_update" in k[0])}
  assert not lookups, lookups
  assert any(scope.startswith("verify") and kind == "all-reduce" for scope, kind, _ in found)
  cfg = embedded.config
  assert (cfg.vocab_size, cfg.hidden_size) in _all_gather_shapes(hlo)  # the table, whole


def _all_gather_shapes(hlo: str) -> set[tuple[int, ...]]:
  return {tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather\(", hlo)}


def _program(target, drafter_type: str):
  """The spec and compiled generate program of `drafter_type` on `target` and its mesh (from
  generate's cache of programs)."""
  found = [(spec, p) for (spec, treedef, *_), p in decoding._COMPILED.items()
           if spec.mesh == target.mesh and spec.config == target.config
           and drafter_type in str(treedef)]
  assert len(found) == 1, f"{len(found)} programs of {drafter_type}"
  return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("name, drafter_type", [("autoregressive", "NoDrafter"),
                                                ("eagle", "EagleConfig(")])
def test_decode_program_gathers_no_weight_and_no_cache(embedded_runs, name, drafter_type):
  """The compiled program (prefill + loop) on dp=2,tp=4 all-gathers neither a whole weight
  matrix nor a KV cache (the target's or EAGLE's own): besides the row-parallel all-reduces only
  activations (logits over a split vocabulary, features) cross devices."""
  on_mesh, _ = embedded_runs
  spec, program = _program(on_mesh, drafter_type)
  gathered = _all_gather_shapes(program.as_text())
  drafter = None if name == "autoregressive" else drafters.build(name, on_mesh)
  weights = {tuple(x.shape) for x in jax.tree.leaves((on_mesh.params, drafter)) if x.ndim >= 2}
  assert not gathered & weights, gathered & weights
  cfg = on_mesh.config
  caches = [s for s in gathered if len(s) == 4 and s[1:] == (spec.cache_len, cfg.num_kv_heads,
                                                              cfg.head_dim)]
  assert not caches, f"a layer's KV cache [B, S, K, D] is all-gathered: {caches}"


# -- 3. the same output on every mesh ------------------------------------------------------------


_TINY_DRAFTERS = {
    "autoregressive": lambda t: None,
    "prompt_lookup": lambda t: drafters.build("prompt_lookup", t, num_branches=2),
    "ngram": lambda t: drafters.build("ngram", t, num_tokens=5, verify_sizes=(0, 2)),
    "token_recycling": lambda t: drafters.build("token_recycling", t),
    "layer_skip": lambda t: drafters.build("layer_skip", t, num_layers=1),
    "draft_lm": lambda t: draft_lm.build(t, draft=tt.draft_target(), num_tokens=3),
    "medusa": lambda t: tt.learned_drafter("medusa", t),
    "hydra": lambda t: tt.learned_drafter("hydra", t),
    "eagle": lambda t: tt.learned_drafter("eagle", t, depth=4, top_k=3, total_tokens=8),
    "eagle3": lambda t: tt.learned_drafter("eagle3", t, depth=4, top_k=3, total_tokens=8),
    "dflash": lambda t: tt.learned_drafter("dflash", t, depth=4, top_k=3, total_tokens=8),
}


def test_every_registered_drafter_is_covered():
  assert set(drafters.names()) <= set(_TINY_DRAFTERS)


@pytest.fixture(scope="module")
def tiny():
  target = tt.mesh_target()
  return target, {name: build(target) for name, build in _TINY_DRAFTERS.items()}


@pytest.fixture(scope="module")
def tiny_reference(tiny):
  """One device, batch 8: the reference result of every method (a row's tokens do not depend on
  the batch in float32: tests/test_speculative.py)."""
  target, built = tiny
  return {name: specjax.generate(target, PROMPTS, max_new_tokens=NEW, drafter=d, pad_to=PAD)
          for name, d in built.items()}


# Batches run per mesh. Batch 4 and 1 are padded to the data axis, so on dp=8 they reuse the
# batch-8 program and on dp=4 they share one program: every size costs one compile at most.
_BATCHES = {"dp=1,tp=8": (8,), "dp=2,tp=4": (8,), "dp=4,tp=2": (8, 4, 1), "dp=8,tp=1": (8, 4, 1)}
_ROWS = {8: slice(0, 8), 4: slice(3, 7), 1: slice(5, 6)}


def _meshes_of(name: str) -> tuple[str, ...]:
  """The meshes a method's matrix runs on: both drafter layouts for every method (a copied
  drafter on dp=4,tp=2, a split one on dp=1,tp=8: the race test reads those programs), and one of
  the other two in turn, so each of the four meshes serves half the methods or more."""
  other = ("dp=2,tp=4", "dp=8,tp=1")[list(_TINY_DRAFTERS).index(name) % 2]
  return tuple(m for m in _BATCHES if m in ("dp=1,tp=8", "dp=4,tp=2", other))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_TINY_DRAFTERS))
def test_greedy_identical_on_every_mesh(tiny, tiny_reference, name):
  """On three of the four meshes (`_meshes_of`), batch 8 (8 unequal prompts), and on those with
  a data axis of 4 or more also batch 4 and 1 (padded with rows that start finished, dropped
  from the result): the tokens equal the single-device ones row for row, and so do tau and the
  acceptance histogram at batch 8."""
  target, built = tiny
  ref = tiny_reference[name]
  for spec in _meshes_of(name):
    batches = _BATCHES[spec]
    on_mesh = target.on_mesh(spec)
    for batch in batches:
      rows = _ROWS[batch]
      got = specjax.generate(on_mesh, PROMPTS[rows], max_new_tokens=NEW, drafter=built[name],
                             pad_to=PAD)
      assert got.tokens == ref.tokens[rows], (spec, batch)
      if batch == 8:
        assert got.stats.accepted_by_depth == ref.stats.accepted_by_depth, spec
        assert got.stats.tau == ref.stats.tau, spec


@pytest.mark.slow
def test_no_collective_races_in_any_program(tiny):
  """Every method's program on both drafter layouts (copied on dp=4,tp=2, split on dp=1,tp=8)
  orders each loop or branch that communicates against every other collective by data
  (`specjax.lab.hlo.races`): none can deadlock devices that enter them in different orders. The
  programs are the matrix's own (compiled there already when it ran first)."""
  target, built = tiny
  assert rounds.PREFILL_CHUNK < PAD  # premise: the prefill's chunk loop is in the programs
  for spec in ("dp=4,tp=2", "dp=1,tp=8"):
    on_mesh = target.on_mesh(spec)
    for drafter in built.values():
      specjax.generate(on_mesh, PROMPTS, max_new_tokens=NEW, drafter=drafter, pad_to=PAD)
    programs = [p for (s, *_), p in decoding._COMPILED.items()
                if s.mesh == on_mesh.mesh and s.config == target.config]
    assert len(programs) >= len(built), spec
    for program in programs:
      text = program.as_text()
      assert "prefill/while" in text, spec
      assert hlo.races(text) == [], (spec, [str(r) for r in hlo.races(text)])


def test_the_matrix_covers_both_drafter_layouts(tiny):
  """Premise of the matrix above: the tiny target's learned drafters are copied whole onto each
  device on tp=2 and split by their rules on tp=8 (`sharding.replicates_drafter`), so both
  layouts are checked for the single-device tokens."""
  target, built = tiny
  learned = [built[n] for n in ("medusa", "hydra", "eagle", "eagle3", "dflash")]
  for spec, copied in (("dp=4,tp=2", True), ("dp=1,tp=8", False)):
    on_mesh = target.on_mesh(spec)
    assert all(sharding.replicates_drafter(d, on_mesh.params, on_mesh.mesh) == copied
               for d in learned), spec


def test_drafters_do_propose_on_the_tiny_target(tiny_reference):
  """Premise of the matrix above: drafts are accepted (tau > 1), so the identity covers accepted
  paths and not only rejections."""
  taus = {name: r.stats.tau for name, r in tiny_reference.items() if name != "autoregressive"}
  accepting = [name for name, tau in taus.items() if tau > 1.05]
  assert len(accepting) >= 5 and {"prompt_lookup", "layer_skip"} <= set(accepting), taus


_CODE = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
         "class Stack:\n    def __init__(self):\n", "for i in range(10):\n",
         "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is prime.\"\"\"\n",
         "x = [", "with open(path) as f:\n", "def add(a, b):\n    return"]
_EMBEDDED_METHODS = ("autoregressive", "eagle", "eagle3")


@pytest.fixture(scope="module")
def embedded_runs(embedded):
  """Each trained method on the embedded default at batch 8, on one device and on dp=2,tp=4
  (its 2 KV heads replicated over the 4-way model axis, its 8 query heads split)."""
  prompts = [embedded.encode(t) for t in _CODE]
  on_mesh = embedded.on_mesh("dp=2,tp=4")
  runs = {}
  for name in _EMBEDDED_METHODS:
    pair = []
    for target in (embedded, on_mesh):
      drafter = None if name == "autoregressive" else drafters.build(name, target)
      pair.append(specjax.generate(target, prompts, max_new_tokens=NEW, drafter=drafter,
                                   pad_to=PAD))
    runs[name] = pair
  return on_mesh, runs


@pytest.mark.slow
@pytest.mark.parametrize("name", _EMBEDDED_METHODS)
def test_embedded_default_identical_on_mesh(embedded_runs, name):
  """The shipped target and its trained drafters (long accepted paths), 8 code prompts of
  unequal lengths: the mesh gives one device's tokens.

  Only the tokens are the contract: the split sums of tensor parallelism (another summation
  order) can reorder near-tied candidates of a draft tree, which changes what is accepted per
  round but never what is emitted."""
  _, runs = embedded_runs
  ref, got = runs[name]
  assert got.tokens == ref.tokens
  if name != "autoregressive":
    assert ref.stats.tau > 2.0  # premise: the trained drafters' long paths are exercised


# (method, its children (None: the default, i.i.d.), the rule).
_SAMPLED_ON_MESHES = [("autoregressive", None, "recursive"), ("prompt_lookup", None, "recursive"),
                      ("eagle", "wor", "recursive"), ("hydra", None, "kseq")]


@pytest.mark.parametrize("name, children, rule", _SAMPLED_ON_MESHES)
def test_sampled_output_identical_across_meshes(tiny, name, children, rule):
  """Temperature 0.8, top-p 0.9, a fixed seed: every mesh draws the same tokens (each row's
  random stream depends on its index and the round only, and threefry is partitionable), for
  sampled children under recursive rejection and under k-sequential selection alike. With the
  exact-law battery on one device (tests/test_speculative.py, tests/test_sampled_children.py)
  this gives the target's law on every mesh."""
  target, built = tiny
  drafter = built[name] if children is None else built[name].replace(
      children=Children(children))
  kwargs = dict(max_new_tokens=NEW, drafter=drafter, temperature=0.8, top_p=0.9, seed=11,
                pad_to=PAD, rule=rule)
  ref = specjax.generate(target, PROMPTS, **kwargs).tokens
  for spec in ("dp=2,tp=4", "dp=8,tp=1"):
    assert specjax.generate(target.on_mesh(spec), PROMPTS, **kwargs).tokens == ref, spec


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["dp=2,tp=4", "dp=4,tp=2"])
def test_pallas_attention_per_device(tiny, tiny_reference, spec):
  """attention_impl="pallas" on a mesh runs the kernel under shard_map (rows over data, heads
  over model, the KV heads split or sliced by the KV-head rule): the XLA single-device tokens."""
  target, built = tiny
  pallas = target.replace(config=target.config.replace(attention_impl="pallas")).on_mesh(spec)
  for name in ("autoregressive", "eagle"):
    got = specjax.generate(pallas, PROMPTS[:4], max_new_tokens=8, drafter=built[name],
                           pad_to=PAD).tokens
    assert got == [r[:8] for r in tiny_reference[name].tokens[:4]], name
