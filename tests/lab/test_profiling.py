"""`specjax.lab.profiling`: the verify-step breakdown (`verify_parts`) and the kernels of a round
(`kernel_times`) behind `bench_roofline`."""

import dataclasses
import math

import jax
import numpy as np
import pytest

import specjax
from specjax import decoding, drafters, rounds
from specjax.decoding import bucket_length, cache_length
from specjax.lab import hlo, phases
from specjax.lab.phases import profile_phases
from specjax.lab.profiling import (
  PARTS,
  hlo_scopes,
  kernel_times,
  scope_of,
  step_read_bytes,
  stream_bandwidth,
  verify_parts,
)
from specjax.sampling import SamplingConfig
from tests.helpers import tiny_targets as tt


@pytest.fixture(scope="module")
def target():
  cfg = specjax.ModelConfig(architecture="qwen3", vocab_size=256, hidden_size=32,
                            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, qk_norm=True, tie_word_embeddings=True,
                            max_position_embeddings=256)
  return specjax.Target.random(cfg)


def test_rows_per_block_size(target):
  rows = verify_parts(target, (1, 4), prompt_len=20, max_new=16, repeats=2, trials=1)
  assert [r["t"] for r in rows] == [1, 4]
  limit = target.config.context_length
  for r in rows:
    assert set(PARTS) <= r.keys()
    assert all(math.isfinite(r[k]) for k in PARTS)
    # The cache `generate` allocates for this prompt, max_new and a chain of T - 1 nodes.
    assert r["cache_slots"] == cache_length(bucket_length(20, limit), 16, r["t"] - 1, limit)
  assert rows[0]["ratio"] == 1.0
  assert rows[1]["ratio"] == rows[1]["phase"] / rows[0]["phase"]


def test_bad_sizes(target):
  with pytest.raises(ValueError, match="block size"):
    verify_parts(target, (0,), prompt_len=8, max_new=8, repeats=1, trials=1)


def test_scope_of_a_name_stack():
  assert scope_of("jit(_verify_loop_program)/while/body/verify/attention/dot_general") == (
      "verify/attention")
  assert scope_of("jit(f)/while/body/draft/attention/mlp/mul") == "draft/mlp"  # innermost part
  assert scope_of("jit(f)/while/body/verify/add") == "verify/other"
  # A drafter's update after verification is a phase of its own, with its own parts.
  assert scope_of("jit(f)/while/body/verify/drafter_update/attention/dot_general") == (
      "drafter_update/attention")
  assert scope_of("") == "other/other"


def test_hlo_scopes_fill_in_instructions_without_metadata():
  """A dot that XLA rewrote without metadata takes its first named operand's scope; control
  flow is left out (its span would hold the kernels inside it)."""
  hlo = "\n".join([
      '  %fusion.1 = f32[1,8]{1,0} fusion(%p.0), kind=kLoop, calls=%c.1, '
      'metadata={op_name="jit(f)/while/body/verify/mlp/mul"}',
      "  %dot.2 = f32[1,4]{1,0} dot(%fusion.1, %p.1), lhs_contracting_dims={1}",
      '  %while.3 = (f32[1,4]{1,0}) while(%tuple.1), condition=%cond, body=%body',
      '  ROOT %fusion.4 = f32[1,4]{1,0} fusion(%dot.2), kind=kLoop, calls=%c.2, '
      'metadata={op_name="jit(f)/while/body/verify/accept/max"}'])
  scopes = hlo_scopes(hlo)
  assert scopes["fusion.1"] == "verify/mlp" and scopes["dot.2"] == "verify/mlp"
  assert scopes["fusion.4"] == "verify/accept" and "while.3" not in scopes


@pytest.mark.parametrize("method", ["autoregressive", "prompt_lookup"])
def test_kernel_times_of_a_round(target, method):
  """Every round launches the target's layers and LM head under the verify phase; a drafter's
  own kernels are filed under draft; the totals add up the scopes."""
  drafter = None if method == "autoregressive" else drafters.build(method, target)
  # After the profiler's own program for the same shapes (kernel_times traces its own).
  profile_phases(target, [list(range(1, 21))], drafter=drafter, max_new_tokens=16, repeats=1,
                 trials=1)
  out = kernel_times(target, [list(range(1, 21))], drafter=drafter, rounds=3, trials=1,
                     max_new_tokens=16)
  total = out.pop("total")
  assert {"verify/attention", "verify/mlp", "verify/lm_head"} <= out.keys()
  assert all(v["kernels"] >= 1 and math.isfinite(v["seconds"]) for v in out.values())
  assert total["kernels"] == pytest.approx(sum(v["kernels"] for v in out.values()))
  assert total["seconds"] == pytest.approx(sum(v["seconds"] for v in out.values()))
  assert out["verify/attention"]["kernels"] >= target.config.num_layers
  if drafter is not None:
    assert any(scope.startswith("draft/") for scope in out)


def test_kernel_times_on_a_mesh(target):
  """On a dp=4, tp=2 mesh every device launches the round's kernels: the counts are those of
  all 8 devices, still filed by phase and part."""
  single = kernel_times(target, [list(range(1, 21))] * 4, rounds=2, trials=1, max_new_tokens=16)
  sharded = kernel_times(target.on_mesh("dp=4,tp=2"), [list(range(1, 21))] * 4, rounds=2,
                         trials=1, max_new_tokens=16)
  assert {"verify/attention", "verify/mlp", "verify/lm_head"} <= sharded.keys()
  assert sharded["verify/attention"]["kernels"] > single["verify/attention"]["kernels"]


def test_kernel_times_bad_rounds(target):
  with pytest.raises(ValueError, match="rounds"):
    kernel_times(target, [[1, 2, 3]], rounds=1)


def test_bench_roofline_kernel_table(target, capsys):
  """`bench_roofline --kernels`: a column pair per entry (autoregressive, an oracle chain), and a
  drafter the target has none of is skipped with the ones it has named."""
  from experiments import bench_roofline
  columns = bench_roofline.kernels(target, "tiny", ["autoregressive", "chain2", "eagle"], 20, 16)
  assert list(columns) == ["autoregressive", "chain2"]
  out = capsys.readouterr().out
  assert "eagle: skipped, 'eagle' is not available for this target" in out
  assert "| phase/part | autoregressive kernels | autoregressive ms | chain2 kernels |" in out
  assert "| verify/attention |" in out and "| total |" in out


def test_profiled_prefill_and_rounds_are_generates_program(target):
  """`profile_phases` times the prefill with `generate`'s own compiled program given a budget of
  one token, which stops after its prefill, and its rounds with the same program given the run's
  budget: no program of its own. It takes over (donates) the cache it is given and writes the
  prompt into it, where one that kept its input would copy the whole cache into a new buffer
  first, a cost `generate` does not pay; and the state it leaves to decode from is the prefill's,
  with the run's own budget."""
  for on in (target, target.on_mesh("dp=4,tp=2")):
    prepared = phases.prepare(on, [list(range(1, 21))], None, 16, SamplingConfig(), None)
    with decoding.mesh_context(prepared.spec.mesh):
      expected = jax.jit(rounds.prefill, static_argnums=0)(prepared.spec, prepared.args,
                                                            prepared.fresh_cache())
    run, state = phases.budget_runs(prepared)
    given = prepared.fresh_cache()
    again = run(given, True)
    assert all(x.is_deleted() for x in jax.tree.leaves(given))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state.cache))
    assert int(state.max_new) == 16 and not state.done[0]  # rows past the first: batch padding
    assert _values(state) == _values(expected)
    assert _values(again.cache) == _values(expected.cache)
    # The whole budget: generate's own run, whose rounds are its target calls after the prefill.
    full = run(prepared.fresh_cache(), False)
    ran = decoding.generate(on, [list(range(1, 21))], max_new_tokens=16, eos_token_id=[])
    assert np.asarray(full.history)[0, 20:36].tolist() == ran.tokens[0]
    assert int(full.rounds) == ran.stats.target_calls - 1 == 15


@pytest.mark.parametrize("method", ["autoregressive", "prompt_lookup", "ngram"])
def test_profile_phases_figures(target, method):
  """Every phase is timed (positive on this machine, spreads not negative); without a drafter
  the draft phase is 0 by definition, and a budget of one token has no round to time. The
  verify phase is a difference of timings (`profile_phases`): its loop chains 20 verifications,
  the fastest of 3 trials, so that a pause of the machine during one call cannot outweigh
  them (with 4 chained on this tiny target, one CI run measured -0.24 ms)."""
  drafter = None if method == "autoregressive" else drafters.build(method, target)
  out = profile_phases(target, [list(range(1, 21))], drafter=drafter, max_new_tokens=16,
                       repeats=10, trials=3)
  assert set(out) == {f"t_{p}{s}" for p in ("prefill", "draft", "verify") for s in ("", "_spread")}
  assert out["t_prefill"] > 0 and out["t_verify"] > 0
  assert all(out[k] >= 0 for k in out if k.endswith("_spread"))
  if drafter is None:
    assert out["t_draft"] == 0.0 and out["t_draft_spread"] == 0.0
  with pytest.raises(ValueError, match="max_new_tokens must be >= 2, got 1"):
    profile_phases(target, [[1, 2, 3]], drafter=drafter, max_new_tokens=1)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_profiler_programs_have_no_collective_races(target, method, monkeypatch):
  """On a mesh the profiler's own programs (the verify loop `profile_phases` times, the loop of
  whole rounds `round_loop` compiles) order every loop or branch that communicates against the
  program's other collectives, as `generate`'s do (`specjax.lab.hlo.races`): the n-gram drafter's
  verify sizes are branches inside them, EAGLE's copied draft reads a gathered table."""
  on_mesh = target.on_mesh("dp=4,tp=2")
  drafter = {"ngram": drafters.build("ngram", on_mesh, num_tokens=6, verify_sizes=(0, 2)),
             "eagle": tt.learned_drafter("eagle", on_mesh)}[method]
  texts = []
  program = phases._verify_loop_program

  def spy(*args):
    texts.append(program.lower(*args).compile().as_text())
    return program(*args)
  monkeypatch.setattr(phases, "_verify_loop_program", spy)
  prompt = [list(range(1, 21))]
  profile_phases(on_mesh, prompt, drafter=drafter, max_new_tokens=16, repeats=1, trials=1)
  texts.append(phases.round_loop(on_mesh, prompt, drafter=drafter, max_new_tokens=16)[1])
  assert len(texts) >= 2  # the verify loop (one per size used) and the round loop
  for text in texts:
    assert hlo.races(text) == [], [str(r) for r in hlo.races(text)]


def _values(tree) -> list[list]:
  return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                     else x).tolist() for x in jax.tree.leaves(tree)]


def test_profile_phases_weighs_the_verify_sizes_a_run_used(target, monkeypatch):
  """A drafter with several verify sizes: the verify phase is timed at each size its run used,
  and at no other (the verify loop is given each size's index), then weighted by the run's
  rounds at each size; the sizes used are those `generate` reports for the same prompt."""
  drafter = drafters.build("ngram", target, num_tokens=6, verify_sizes=(0, 2, 4))
  prompt = [5, 6, 7, 8] * 5
  ran = decoding.generate(target, [prompt], max_new_tokens=16, drafter=drafter, eos_token_id=[])
  used = [i for i, k in enumerate(ran.stats.rounds_by_size.values()) if k]
  assert len(used) >= 2  # a repetitive prompt, then the target's own text: several lengths
  timed = []
  loop = phases._verify_loop_program

  def spy(spec, args, state, n_verify, size):
    if n_verify:  # a loop of no verification is the baseline, whatever its size
      timed.append(int(size))
    return loop(spec, args, state, n_verify, size)

  monkeypatch.setattr(phases, "_verify_loop_program", spy)
  out = profile_phases(target, [prompt], drafter=drafter, max_new_tokens=16, repeats=2, trials=2)
  assert set(timed) == set(used)
  assert math.isfinite(out["t_verify"]) and math.isfinite(out["t_draft"])


def test_weight_streaming_floor(target):
  """`step_read_bytes` counts every weight once per device: all of them on one device, each
  device's shard on a mesh (norm weights stay whole, so a split halves less than all), and an
  untied input embedding not at all (a step looks up one row). `bench_roofline.weight_floor`
  divides it by `stream_bandwidth`, a measured rate."""
  from experiments import bench_roofline
  total = sum(int(x.nbytes) for x in jax.tree.leaves(target.params))
  assert step_read_bytes(target) == total
  sharded = target.on_mesh("dp=4,tp=2")
  assert total / 2 < step_read_bytes(sharded) < total
  untied = specjax.Target.random(dataclasses.replace(target.config, tie_word_embeddings=False))
  table = untied.config.vocab_size * untied.config.hidden_size * 4
  untied_total = sum(int(x.nbytes) for x in jax.tree.leaves(untied.params))
  assert step_read_bytes(untied) == untied_total - table
  for mesh in (None, sharded.mesh):
    rate = stream_bandwidth(mesh, nbytes=1 << 20, repeats=2, trials=1)
    assert math.isfinite(rate) and rate > 0
  floor = bench_roofline.weight_floor(sharded)
  assert floor["bytes"] == step_read_bytes(sharded)
  assert floor["seconds"] == floor["bytes"] / floor["bandwidth"] > 0
  with pytest.raises(ValueError, match="nbytes"):
    stream_bandwidth(None, nbytes=16)
