"""The README's Python snippets run as written: each defines what it uses. Checked for the
sections whose snippets are meant to be pasted (one subprocess, each snippet in a fresh
namespace, shorter generations so the check stays cheap)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from specjax import assets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("Speculative decoding", "Learned drafters", "Use it from Python")

_RUNNER = """
import sys
for i, code in enumerate(sys.argv[1:]):
  exec(compile(code, f"<README snippet {i}>", "exec"), {"__name__": "__main__"})
"""


def snippets(section: str) -> list[str]:
  """The ```python blocks of a `## ` section of the README (its `###` subsections included)."""
  text = open(os.path.join(ROOT, "README.md")).read()
  body = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
  assert body, f"no section {section!r} in the README"
  return re.findall(r"^```python\n(.*?)^```", body.group(1), re.M | re.S)


def test_readme_snippets_run(tmp_path):
  codes = [code for section in SECTIONS for code in snippets(section)]
  assert len(codes) == 3
  # Paths to the shipped folders work from the repository root; the run is elsewhere (what a
  # snippet writes lands in tmp_path), so they are made absolute. Fewer tokens, same calls.
  codes = [re.sub(r"max_new_tokens=\d+", "max_new_tokens=8",
                  code.replace('"specjax/assets/', f'"{assets.ASSETS_DIR}/')) for code in codes]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
  r = subprocess.run([sys.executable, "-c", _RUNNER, *codes], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert os.path.isfile(tmp_path / "out" / "target" / "config.json")
