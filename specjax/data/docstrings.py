"""TFDS builder `stdlib_docstrings`: docstring-to-code prompts from the held-out stdlib files.

HumanEval's prompts are docstrings the target never saw, written for a benchmark; the held-out
stdlib snippets are openings of files, mostly imports and code. This set sits between them: every
documented function or method of the held-out split, cut after its docstring, so the target
writes a body it never saw from a specification in prose, in the layout HumanEval uses. Built from
`stdlib_code`'s held-out split (no other source), cached in the same data dir.
"""

from __future__ import annotations

import ast
import platform
import textwrap
from collections.abc import Iterator

import tensorflow_datasets as tfds

from specjax.data import storage
from specjax.data.stdlib_code import load_stdlib_code

FIELDS = ('path', 'name', 'prompt', 'body')
# A docstring shorter than this is a label ("Return the name."), not a specification.
MIN_DOCSTRING_CHARS = 40


def documented_functions(path: str, source: str) -> Iterator[dict[str, str]]:
  """`{path, name, prompt, body}` per documented function of `source`, in source order: the
  prompt runs from the `def` line through the docstring's last line, dedented, and the body is
  the rest of the function."""
  try:
    tree = ast.parse(source)
  except SyntaxError:  # the stdlib ships a few deliberately broken files (lib2to3 test data)
    return
  lines = source.splitlines(keepends=True)
  for node in sorted(ast.walk(tree), key=lambda n: getattr(n, 'lineno', 0)):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
      continue
    doc = ast.get_docstring(node, clean=False)
    if doc is None or len(doc.strip()) < MIN_DOCSTRING_CHARS:
      continue
    start, split, end = node.lineno - 1, node.body[0].end_lineno, node.end_lineno
    prompt = textwrap.dedent("".join(lines[start:split]))
    body = textwrap.dedent("".join(lines[split:end]))
    if prompt.strip() and body.strip():
      yield {'path': path, 'name': node.name, 'prompt': prompt, 'body': body}


class StdlibDocstrings(storage.LocalBuilder, tfds.core.GeneratorBasedBuilder):
  """One `test` split: the documented functions of the held-out stdlib files, ordered by file
  and line. `info.metadata['python_version']` records the interpreter whose stdlib was read."""

  name = 'stdlib_docstrings'
  # One copy per Python version, as the corpus it is cut from (`python_3_11_7`).
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(
      name='python_' + platform.python_version().replace('.', '_').replace('+', ''))]
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Documented functions of held-out stdlib files, cut after the '
                            'docstring.'}

  def __init__(self, *, source_data_dir=None, **kwargs):
    self._source_data_dir = source_data_dir
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return storage.text_info(self, FIELDS, python_version=platform.python_version())

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    files = sorted(load_stdlib_code('heldout', self._source_data_dir), key=lambda ex: ex['path'])
    return {'test': self._generate_examples(files)}

  def _generate_examples(self, files) -> Iterator[tuple[str, dict[str, str]]]:
    for ex in files:
      for i, fn in enumerate(documented_functions(ex['path'], ex['text'])):
        yield f"{ex['path']}:{i}", fn


def load_stdlib_docstrings(data_dir=None) -> storage.TextRecords:
  """The prompts as `{path, name, prompt, body}` str dicts, built on first use."""
  builder = storage.prepare(lambda: StdlibDocstrings(
      source_data_dir=data_dir, data_dir=storage.resolve_data_dir(data_dir),
      file_format=storage.FILE_FORMAT))
  return storage.records(builder, 'test')
