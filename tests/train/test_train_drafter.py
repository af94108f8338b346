"""The drafter trainer: exact resume after an interruption, self-distillation, export and load.

Tiny runs against the shipped target (its forward is cheap at 2 x 32 tokens) on a folder of
stdlib files: the same code path as the shipped drafters' training, with a few steps.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import assets
from specjax.config_utils import load_config, to_dict
from specjax.drafters import eagle3, learned
from specjax.train.drafter import heldout_scores, match_counts, train_drafter
from tests.helpers.corpora import stdlib_source_dir

_TINY = ["optim.total_steps=6", "optim.warmup_steps=2", "seq_len=32", "batch_size=2",
         "eval_every=3", "save_every=2", "eval_rows=4", "draft_vocab_size=512",
         "distill_rows=6", "distill_prompt_tokens=8", "distill_new_tokens=24", "distill_batch=4",
         "export_dtype=float32"]


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> str:
  """A dozen stdlib files, two of them hashing into the held-out split."""
  return stdlib_source_dir(tmp_path_factory.mktemp("src"), ("json",))


@pytest.fixture(scope="module")
def target():
  return specjax.load_target(assets.TARGET_DIR, dtype="float32")


def _config(method, source_dir, workdir, *extra):
  return load_config(f"configs/{method}_stdlib.py", _TINY + [
      f"source_dir={source_dir}", f"data_dir={os.path.join(os.fspath(workdir), '..', 'tfds')}",
      f"workdir={workdir}", f"export_dir={os.path.join(os.fspath(workdir), 'export')}",
      f"distill_cache={os.path.join(os.fspath(workdir), '..', 'distill')}", *extra])


def _assert_params_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eagle3_resume_after_interruption_is_bitwise_identical(source_dir, target, tmp_path):
  """Stopping after 1 and then 2 more steps (between and on checkpoints) and resuming gives the
  uninterrupted run's parameters bit for bit, with self-distilled data (generated once, cached)
  and EAGLE-3's training-time-test loss."""
  straight = train_drafter(_config("eagle3", source_dir, tmp_path / "a"), progress=False,
                           target=target)
  assert straight["finished"] and straight["step"] == 6
  cfg = _config("eagle3", source_dir, tmp_path / "b")
  first = train_drafter(cfg, stop_after=1, progress=False, target=target)
  assert not first["finished"] and first["step"] == 1
  second = train_drafter(cfg, stop_after=2, progress=False, target=target)
  assert second["step"] == 3
  resumed = train_drafter(cfg, progress=False, target=target)
  assert resumed["finished"] and resumed["step"] == 6
  _assert_params_equal(straight["params"], resumed["params"])
  assert len(glob.glob(os.path.join(tmp_path, "distill", "distill-*.npy"))) == 1


def test_dflash_random_anchors_resume_exactly(source_dir, target, tmp_path):
  """DFlash's random anchors are drawn from the step's key: a run stopped after 3 steps and
  resumed (between checkpoints) ends with the uninterrupted run's parameters bit for bit."""
  opts = ("source=corpus", "family.num_anchors=6")
  straight = train_drafter(_config("dflash", source_dir, tmp_path / "a", *opts), progress=False,
                           target=target)
  cfg = _config("dflash", source_dir, tmp_path / "b", *opts)
  assert train_drafter(cfg, stop_after=3, progress=False, target=target)["step"] == 3
  resumed = train_drafter(cfg, progress=False, target=target)
  assert resumed["finished"] and resumed["step"] == 6
  _assert_params_equal(straight["params"], resumed["params"])


def test_dflash_fine_tuning_may_widen_the_block(source_dir, target, tmp_path):
  """No DFlash parameter depends on the block size (`DFlashFamily.free_fields`): a run with a
  longer block starts from a trained folder's params exactly and trains its new depths, and the
  export drafts that block losslessly. Any other network change is still refused by name."""
  opts = ("source=corpus", "family.num_anchors=4", "family.block_size=4", "train_steps=3",
          "eval_depth=3")
  base = train_drafter(_config("dflash", source_dir, tmp_path / "b4", *opts), progress=False,
                       target=target)
  wide = ("source=corpus", "family.num_anchors=4", "family.block_size=6", "train_steps=5",
          "eval_depth=5", f"init_from={base['export_dir']}")
  cfg = _config("dflash", source_dir, tmp_path / "b6", *wide)
  start = train_drafter(cfg, stop_after=0, progress=False, target=target)
  _assert_params_equal(start["params"], base["params"])
  tuned = train_drafter(cfg, progress=False, target=target)
  assert tuned["finished"] and len(tuned["metadata"]["heldout_agreement_by_depth"]) == 5
  drafter = specjax.load_drafter(tuned["export_dir"], target)
  assert drafter.net.block_size == 6 and drafter.depth == 5
  prompt = [target.encode("def add(a, b):\n    return")]
  ours = specjax.generate(target, prompt, max_new_tokens=24, drafter=drafter)
  assert ours.tokens == specjax.generate(target, prompt, max_new_tokens=24).tokens
  with pytest.raises(ValueError, match=r"another network than this run's options make: "
                                       r"model.num_kv_heads: 8 \(run: 4\)"):
    train_drafter(_config("dflash", source_dir, tmp_path / "bad", *wide, "family.num_kv_heads=4"),
                  progress=False, target=target)


def test_self_distillation_resumes_from_its_chunks(source_dir, target, tmp_path, monkeypatch,
                                                  capsys):
  """Self-distillation saves each generated chunk as it goes: killed after one of three chunks it
  leaves that chunk on disk, resumes from it (generating only the rest) and ends with the rows of
  an uninterrupted run bit for bit; the finished cache is one file, reused without generating."""
  from specjax.train import drafter as D
  cfg = _config("eagle", source_dir, tmp_path / "run", "distill_rows=10", "distill_batch=4")
  stream = D._corpus_stream(cfg, target, "train")
  straight = D.self_distill_rows(
      dataclasses.replace(cfg, distill_cache=os.fspath(tmp_path / "straight")), target, stream,
      cfg.distill_rows, cfg.seed)
  assert straight.shape == (10, 8 + 24)
  generate, calls = D.decoding.generate, []

  def counted(*args, limit=None, **kwargs):
    calls.append(len(args[1]))
    if limit is not None and len(calls) > limit:
      raise KeyboardInterrupt  # the run is killed during its second chunk
    return generate(*args, **kwargs)

  monkeypatch.setattr(D.decoding, "generate", lambda *a, **k: counted(*a, limit=1, **k))
  with pytest.raises(KeyboardInterrupt):
    D.self_distill_rows(cfg, target, stream, cfg.distill_rows, cfg.seed)
  chunks = glob.glob(os.path.join(cfg.distill_cache, "distill-*.chunks", "*.npy"))
  assert len(chunks) == 1 and not glob.glob(os.path.join(cfg.distill_cache, "*.npy"))
  calls.clear()
  monkeypatch.setattr(D.decoding, "generate", counted)
  resumed = D.self_distill_rows(cfg, target, stream, cfg.distill_rows, cfg.seed, progress=True)
  assert calls == [4, 2]  # the two missing chunks only
  assert "generating 10 self-distilled rows" in capsys.readouterr().out
  np.testing.assert_array_equal(resumed, straight)
  assert resumed.dtype == straight.dtype == np.int32
  assert len(glob.glob(os.path.join(cfg.distill_cache, "distill-*.npy"))) == 1
  assert not glob.glob(os.path.join(cfg.distill_cache, "*.chunks"))
  calls.clear()
  np.testing.assert_array_equal(
      D.self_distill_rows(cfg, target, stream, cfg.distill_rows, cfg.seed), straight)
  assert calls == []  # the finished cache is reused


def test_drafter_exports_default_to_the_workdir(source_dir, tmp_path):
  """The shipped recipes export into their workdir (`runs/<name>/export`), never into the
  shipped assets unless `export_dir` names them."""
  for method in ("medusa", "hydra", "eagle", "eagle3", "dflash"):
    cfg = load_config(f"configs/{method}_stdlib.py")
    assert cfg.export_dir is None and cfg.workdir == f"runs/{method}_stdlib"
  for name in ("target_stdlib", "draft_lm_stdlib"):
    cfg = load_config(f"configs/{name}.py")
    assert cfg.export_dir is None and cfg.workdir == f"runs/{name}"
  cfg = load_config("configs/eagle_stdlib.py", ["export_dir=specjax/assets/eagle"])
  assert cfg.export_dir == "specjax/assets/eagle"


def test_feature_noise_is_drawn_per_step_and_resumes_exactly(source_dir, target, tmp_path):
  """EAGLE's feature noise changes what is learned, and its draws are keyed by the step: a run
  stopped after 3 steps and resumed ends with the uninterrupted run's parameters bit for bit."""
  noisy = ("source=corpus", "family.feature_noise=0.5")
  straight = train_drafter(_config("eagle", source_dir, tmp_path / "a", *noisy), progress=False,
                           target=target)
  cfg = _config("eagle", source_dir, tmp_path / "b", *noisy)
  train_drafter(cfg, stop_after=3, progress=False, target=target)
  resumed = train_drafter(cfg, progress=False, target=target)
  _assert_params_equal(straight["params"], resumed["params"])
  clean = train_drafter(_config("eagle", source_dir, tmp_path / "c", "source=corpus"),
                        progress=False, target=target)
  assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
      jax.tree.leaves(straight["params"]), jax.tree.leaves(clean["params"])))


def test_resuming_with_other_settings_is_refused(source_dir, target, tmp_path):
  """A workdir remembers the settings its run started with: resuming it under another schedule
  is refused with the differing field named; logging settings may change."""
  workdir = tmp_path / "run"
  train_drafter(_config("medusa", source_dir, workdir, "source=corpus"), stop_after=1,
                progress=False, target=target)
  with pytest.raises(ValueError, match=r"optim\.total_steps: 6 -> 12"):
    train_drafter(_config("medusa", source_dir, workdir, "source=corpus",
                          "optim.total_steps=12"), progress=False, target=target)
  resumed = train_drafter(_config("medusa", source_dir, workdir, "source=corpus", "log_every=1",
                                  "eval_every=6"), progress=False, target=target)
  assert resumed["finished"] and resumed["step"] == 6


# Options a family needs on the tiny rows (DFlash's recipe draws 64 anchors from rows of 256).
_TINY_OPTIONS = {"dflash": ("family.num_anchors=8",)}


@pytest.mark.parametrize("method", ["medusa", "hydra", "eagle", "eagle3", "dflash"])
def test_training_exports_a_loadable_drafter(source_dir, target, tmp_path, method):
  """A short corpus run lowers the loss, exports a folder with metadata, and the folder loads
  (bfloat16 weights) into a drafter whose greedy output equals autoregressive decoding."""
  cfg = _config(method, source_dir, tmp_path / method, "source=corpus",
                "export_dtype=bfloat16", "optim.total_steps=8", "optim.learning_rate=0.003",
                "log_every=1", *_TINY_OPTIONS.get(method, ()))
  summary = train_drafter(cfg, progress=False, target=target)
  losses = [r["loss"] for r in summary["history"] if "loss" in r]
  assert losses[-1] < losses[0]
  meta = summary["metadata"]
  assert meta["steps"] == 8 and meta["draft_vocab_size"] == 512
  assert len(meta["heldout_agreement_by_depth"]) == cfg.eval_depth
  assert 1.0 <= meta["heldout_chain_tau"] <= 1.0 + cfg.eval_depth
  assert 0 < meta["draft_vocab_coverage"] <= 1
  assert meta["provenance"]["versions"]["jax"] and meta["provenance"]["date_utc"]
  on_disk = json.loads(open(os.path.join(summary["export_dir"], "metadata.json")).read())
  assert on_disk["heldout_agreement_by_depth"] == meta["heldout_agreement_by_depth"]
  drafter = specjax.load_drafter(summary["export_dir"], target)
  prompt = [target.encode("def add(a, b):\n    return")]
  ours = specjax.generate(target, prompt, max_new_tokens=24, drafter=drafter)
  assert ours.tokens == specjax.generate(target, prompt, max_new_tokens=24).tokens


def test_eagle3_taps_are_configurable(source_dir, target, tmp_path):
  """`target_layers` picks the target states EAGLE-3 fuses (here the top one alone, the tap
  ablation): the fc reads that many features, the export records the taps, and the loaded drafter
  reads them and stays lossless. Taps outside the target are refused before any training."""
  cfg = _config("eagle3", source_dir, tmp_path / "top", "source=corpus", "family.target_layers=6")
  summary = train_drafter(cfg, progress=False, target=target)
  config = json.loads(open(os.path.join(summary["export_dir"], "config.json")).read())
  assert config["hidden_layers"] == [6] and config["net"]["num_features"] == 1
  drafter = specjax.load_drafter(summary["export_dir"], target)
  assert drafter.hidden_layers == (6,)
  # The folder, re-evaluated from its metadata, scores what its training measured.
  scores = heldout_scores(summary["export_dir"], target)
  meta = summary["metadata"]
  assert [round(scores[f"agree_{d + 1}"], 4) for d in range(5)] == meta[
      "heldout_agreement_by_depth"]
  assert round(scores["chain_tau"], 4) == meta["heldout_chain_tau"]
  prompt = [target.encode("def add(a, b):\n    return")]
  ours = specjax.generate(target, prompt, max_new_tokens=24, drafter=drafter)
  assert ours.tokens == specjax.generate(target, prompt, max_new_tokens=24).tokens
  with pytest.raises(ValueError, match=r"target_layers \[7\] are outside \[0, 6\]"):
    train_drafter(_config("eagle3", source_dir, tmp_path / "bad", "source=corpus",
                          "family.target_layers=2,7"), progress=False, target=target)
  assert not os.path.exists(tmp_path / "bad")


def test_eagle3_frozen_head_keeps_the_targets_head(source_dir, target, tmp_path):
  """`frozen_head` (the head ablation) trains EAGLE-3's layer while its final norm and LM head
  stay the target's, restricted to the draft vocabulary, even under weight decay."""
  summary = train_drafter(_config("eagle3", source_dir, tmp_path / "frozen", "source=corpus",
                                  "family.frozen_head=true", "optim.weight_decay=0.1"),
                          progress=False, target=target)
  params = summary["params"]
  np.testing.assert_array_equal(
      np.asarray(params["lm_head"]["kernel"][...]),
      np.asarray(learned.restricted_head(target.config, target.params, summary["d2t"])))
  np.testing.assert_array_equal(np.asarray(params["norm"]["weight"][...]),
                                np.asarray(target.params["norm"]["weight"][...]))
  trained = train_drafter(_config("eagle3", source_dir, tmp_path / "trained", "source=corpus",
                                  "optim.weight_decay=0.1"), progress=False, target=target)
  for name in ("lm_head", "norm"):  # what the option holds still does train without it
    assert not np.array_equal(np.asarray(jax.tree.leaves(trained["params"][name])[0]),
                              np.asarray(jax.tree.leaves(params[name])[0]))
  init = learned.init_params(eagle3.Eagle3Net, eagle3.FAMILY.make_config(
      target.config, draft_vocab_size=512, num_features=3), 0)
  for name in ("fc", "layer"):  # while the rest of the drafter trains
    assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
        jax.tree.leaves(init[name]), jax.tree.leaves(params[name]), strict=True))


def test_chain_loss_scores_depths_only_along_agreeing_chains(target):
  """The acceptance-aware loss scores depth s + 1 only at starts where the drafter's top-1 agreed
  with the target at depths 1..s, averaged over all starts; depth 1 is the plain loss. Checked
  against a numpy reference with hand-made draft logits (a family whose training view returns
  its params as the logits)."""
  from specjax.train import drafter as D
  class HandMade(eagle3.Eagle3Family):
    def depth_logits(self, net, params, x, num_steps, *, train=False):
      return params, jnp.zeros(())

  setup = D._Setup(HandMade(), None, target.config, (target.config.num_layers,))
  v, t, steps = target.config.vocab_size, 10, 3
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, v, (1, t)), jnp.int32)
  d2t = jnp.arange(v, dtype=jnp.int32)
  frozen = D.Frozen(target=target.params, d2t=d2t, head=None,
                    emb=learned.target_embedding(target.config, target.params))
  logits = np.asarray(D._target_view(setup, frozen, tokens)[1][0])
  want = logits.argmax(-1)
  hits = np.random.default_rng(1).random((steps, t)) < 0.6
  draft = np.zeros((steps, 1, t, v), np.float32)
  for s in range(steps):
    for i in range(t - s - 1):  # depth s + 1 from start i drafts the token at i + s + 2
      draft[s, 0, i, want[i + s + 1] if hits[s, i] else (want[i + s + 1] + 1) % v] = 4.0
  batch = D.DrafterBatch(frozen, tokens)
  cfg = load_config("configs/eagle3_stdlib.py", ["train_steps=3", "chain_loss=true"])
  _, metrics = D.drafter_loss(setup, cfg, jnp.asarray(draft), batch)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  chain = np.ones(t, bool)
  for s in range(steps):
    n = t - s - 1
    logq = draft[s, 0, :n] - np.log(np.exp(draft[s, 0, :n]).sum(-1, keepdims=True))
    ce = -(p[s + 1:] * logq).sum(-1)
    on = chain[:n]  # scored where the chain still holds, averaged over all n starts
    np.testing.assert_allclose(float(metrics[f"ce_{s + 1}"]), (ce * on).sum() / n, rtol=1e-5)
    chain = on & hits[s, :n]
    np.testing.assert_allclose(float(metrics[f"chain_{s + 1}"]), chain.mean(), rtol=1e-6)
  assert 0 < chain.sum() < hits[0, :t - steps].sum()  # the chains did thin out


def test_chain_counts_need_every_shallower_depth():
  """Per-depth agreement counts a hit wherever it falls; the chain count only where every
  shallower depth from the same start hit too, over the starts that have all depths in the row."""
  hits = [jnp.asarray([[1, 1, 0, 1, 1]], bool),   # depth 1 from starts 0..4
          jnp.asarray([[1, 0, 1, 1]], bool),      # depth 2 from starts 0..3
          jnp.asarray([[1, 1, 1]], bool)]         # depth 3 from starts 0..2
  counts = np.asarray(match_counts(hits))
  np.testing.assert_array_equal(counts[:, :2], [[4, 5], [3, 4], [3, 3]])
  # starts 0..2: depth 1 hits at 0, 1; depths 1-2 at 0; depths 1-3 at 0.
  np.testing.assert_array_equal(counts[:, 2:], [[2, 3], [1, 3], [1, 3]])


def test_bad_configs_are_rejected():
  with pytest.raises(ValueError, match="unknown learned drafter method"):
    load_config("configs/eagle3_stdlib.py", ["method=medusa2"])
  with pytest.raises(ValueError, match="train_steps >= 3"):
    load_config("configs/eagle3_stdlib.py", ["train_steps=2"])
  with pytest.raises(ValueError, match="must not exceed"):
    load_config("configs/medusa_stdlib.py", ["eval_depth=5"])
  with pytest.raises(ValueError, match="source must be"):
    load_config("configs/eagle_stdlib.py", ["source=web"])
  with pytest.raises(ValueError, match=r"feature_noise is not an option of hydra .*read by "
                     r"\['eagle', 'eagle3'\]"):
    load_config("configs/hydra_stdlib.py", ["family.feature_noise=0.1"])
  with pytest.raises(ValueError, match="feature_noise must be a float >= 0"):
    load_config("configs/eagle_stdlib.py", ["family.feature_noise=-0.1"])
  with pytest.raises(ValueError, match=r"target_layers is not an option of eagle .*read by "
                     r"\['dflash', 'eagle3'\]"):
    load_config("configs/eagle_stdlib.py", ["family.target_layers=3,6"])
  with pytest.raises(ValueError, match=r"frozen_head is not an option of eagle .*read by "
                     r"\['eagle3'\]"):
    load_config("configs/eagle_stdlib.py", ["family.frozen_head=true"])
  with pytest.raises(ValueError, match="chain_loss scores depths past the first"):
    load_config("configs/eagle_stdlib.py", ["chain_loss=true"])
  with pytest.raises(ValueError, match="distinct layer ids"):
    load_config("configs/eagle3_stdlib.py", ["family.target_layers=6,6"])


def test_fine_tuning_starts_from_a_drafter_folder(source_dir, target, tmp_path):
  """`init_from` starts a run from a trained folder's params and draft vocabulary (here the
  exported base run's, trained on the plain corpus, fine-tuned on self-distilled rows), trains
  on, exports a lossless drafter and records where it started and the start's own metadata. A
  folder of another family, network or taps is refused by name before the run writes anything."""
  base = train_drafter(_config("eagle3", source_dir, tmp_path / "base", "source=corpus"),
                       progress=False, target=target)
  folder = base["export_dir"]
  cfg = _config("eagle3", source_dir, tmp_path / "tuned", f"init_from={folder}")
  start = train_drafter(cfg, stop_after=0, progress=False, target=target)
  assert start["step"] == 0
  _assert_params_equal(start["params"], base["params"])  # float32 export: exact
  np.testing.assert_array_equal(start["d2t"], base["d2t"])
  tuned = train_drafter(cfg, progress=False, target=target)
  meta = tuned["metadata"]
  assert tuned["finished"] and meta["training"]["init_from"] == folder
  assert meta["started_from"] == base["metadata"]  # the lineage: how the start was made
  assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
      jax.tree.leaves(tuned["params"]), jax.tree.leaves(base["params"])))
  drafter = specjax.load_drafter(tuned["export_dir"], target)
  prompt = [target.encode("def add(a, b):\n    return")]
  ours = specjax.generate(target, prompt, max_new_tokens=24, drafter=drafter)
  assert ours.tokens == specjax.generate(target, prompt, max_new_tokens=24).tokens
  bad = {"dflash": ("is a eagle3 drafter, this run trains dflash", "family.num_anchors=8"),
         "eagle3": (r"another network than this run's options make: draft_vocab_size: 512 "
                    r"\(run: 256\)", "draft_vocab_size=256")}
  for method, (message, option) in bad.items():
    with pytest.raises(ValueError, match=message):
      train_drafter(_config(method, source_dir, tmp_path / f"bad_{method}", "source=corpus",
                            f"init_from={folder}", option), progress=False, target=target)
    assert not os.path.exists(tmp_path / f"bad_{method}")
  with pytest.raises(ValueError, match=r"reads target layers \[2, 4, 6\], this run's taps are "
                                       r"\[1, 3, 5\]"):
    train_drafter(_config("eagle3", source_dir, tmp_path / "bad_taps", "source=corpus",
                          f"init_from={folder}", "family.target_layers=1,3,5"), progress=False,
                  target=target)


def test_configs_recorded_in_the_flat_form_are_read(tmp_path):
  """Settings recorded before a family's options were its `family` group (every family's options
  beside the other fields) are read in the current form: such a workdir resumes with the same
  settings and refuses others by name, and such metadata rebuilds the run's config."""
  from specjax.train import drafter as D
  from specjax.train import loop
  cfg = load_config("configs/dflash_stdlib.py", [f"workdir={tmp_path}"])
  record = to_dict(cfg)
  flat = {k: v for k, v in record.items() if k != "family"} | record["family"] | {
      "num_heads": 4, "regression_weight": 1.0, "feature_noise": 0.0, "frozen_head": False}
  assert D.config_from_metadata(flat) == cfg
  with open(tmp_path / loop.RUN_CONFIG, "w") as f:
    json.dump({k: v for k, v in flat.items() if k not in loop.NOT_RUN_SETTINGS}, f)
  loop.check_run_config(os.fspath(tmp_path), cfg, recorded_as=D.recorded_form)
  other = dataclasses.replace(cfg, family=dataclasses.replace(cfg.family, num_anchors=32))
  with pytest.raises(ValueError, match=r"family\.num_anchors: 64 -> 32"):
    loop.check_run_config(os.fspath(tmp_path), other, recorded_as=D.recorded_form)
