"""A learned family is one file: the test-only family in `toy_family.py`, registered here, goes
through the same entry points as the shipped families -- the trainer (train, export), the
loader, `experiments.tune_tree` and `experiments.compare_drafters` -- with no edit elsewhere."""

from __future__ import annotations

import json
import os

import pytest

import specjax
from experiments import compare_drafters, tune_tree
from specjax import assets, drafters
from specjax.drafters import io, registry
from specjax.train.drafter import DrafterTrainConfig, train_drafter
from specjax.train.optim import OptimConfig
from tests.helpers import toy_family
from tests.helpers.corpora import stdlib_source_dir


@pytest.fixture(scope="module")
def family():
  fam = io.register_family(toy_family.ToyFamily())
  yield fam
  registry.unregister(toy_family.NAME)


@pytest.fixture(scope="module")
def target():
  return specjax.load_target(assets.TARGET_DIR, dtype="float32")


@pytest.fixture(scope="module")
def exported(family, target, tmp_path_factory):
  """A few training steps of the toy family on stdlib files, exported."""
  root = tmp_path_factory.mktemp("toy")
  cfg = DrafterTrainConfig(
      method=toy_family.NAME, source="corpus",
      optim=OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=6),
      source_dir=stdlib_source_dir(tmp_path_factory.mktemp("src"), ("json",)),
      data_dir=os.fspath(root / "tfds"), seq_len=32, batch_size=2, draft_vocab_size=512,
      train_steps=2, eval_depth=3, eval_every=3, save_every=2, eval_rows=4, log_every=1,
      workdir=os.fspath(root / "run"), export_dir=os.fspath(root / "export"),
      export_dtype="float32")
  summary = train_drafter(cfg, progress=False, target=target)
  assert summary["finished"]
  losses = [r["loss"] for r in summary["history"] if "loss" in r]
  assert losses[-1] < losses[0]
  return summary


def test_the_family_is_registered_and_not_offered_without_a_shipped_folder(family, target):
  assert toy_family.NAME in registry.families()
  assert toy_family.NAME not in drafters.available(target)  # nothing shipped for it


def test_trains_exports_and_loads_lossless(exported, target):
  meta = exported["metadata"]
  assert meta["method"] == toy_family.NAME and len(meta["heldout_agreement_by_depth"]) == 3
  drafter = specjax.load_drafter(exported["export_dir"], target, num_tokens=4)
  assert isinstance(drafter, toy_family.ToyChain) and drafter.num_nodes == 4
  prompts = [target.encode("def add(a, b):\n    return"), target.encode("import os\n")]
  ours = specjax.generate(target, prompts, max_new_tokens=24, drafter=drafter)
  assert ours.tokens == specjax.generate(target, prompts, max_new_tokens=24).tokens


def test_tunes_its_tree_and_saves_the_default(exported, target, capsys):
  folder = exported["export_dir"]
  tune_tree.main(["--method", toy_family.NAME, "--path", folder, "--num-prompts", "1",
                  "--max-new-tokens", "8", "--save"])
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith('| {"num_tokens"')]
  assert len(rows) == 2, out  # the family's own grid
  tree = json.loads(open(os.path.join(folder, "config.json")).read())["tree"]
  assert tree["num_tokens"] in (2, 3) and tree["recent_tokens"] == tune_tree.RECENT_TOKENS
  assert drafters.build(toy_family.NAME, target, path=folder).num_nodes == tree["num_tokens"]


def test_compares_beside_a_shipped_family(exported, capsys):
  compare_drafters.main(["--drafter", f"{toy_family.NAME}={exported['export_dir']}",
                         "--drafter", "eagle", "--trees", "2", "--num-prompts", "1",
                         "--max-new-tokens", "8", "--datasets", "humaneval"])
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
  assert rows[1].startswith(f"| {toy_family.NAME}=") and rows[2].startswith("| eagle |")
  for row in rows[1:]:
    assert 1.0 <= float(row.split("|")[3]) <= 4.0  # held-out chain tau of a depth-3 eval
    assert 1.0 <= float(row.split("|")[-2]) <= 3.0  # a chain of 2 emits at most 3 per call
  with pytest.raises(ValueError, match="does not fit toy_chain"):
    compare_drafters.tree_options("7x3x16", toy_family.NAME)
