"""Compiled programs are reused where only values change: sampling values, generation lengths
and batch sizes inside a bucket; and the persistent compilation cache serves a second process.

Compilations are counted from `jax.log_compiles()`' own messages, so what is counted is what XLA
compiled, not what specjax believes it cached.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import compile_cache, decoding, drafters
from specjax.sampling import SamplingConfig, process_logits
from tests.helpers import tiny_targets as tt

PROGRAM = "jit(generate_program)"


@contextlib.contextmanager
def count_compiles(name: str = PROGRAM):
  """Yields a list that ends up holding one entry per XLA compilation of `name`."""
  seen: list[str] = []

  class Handler(logging.Handler):
    def emit(self, record):
      message = record.getMessage()
      if message.startswith("Finished XLA compilation of") and name in message:
        seen.append(message)

  handler = Handler(level=logging.DEBUG)
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      yield seen
  finally:
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def target():
  return tt.scaled_target(tt.config(64), seed=3)


PROMPTS = [[5, 17, 3, 8, 41, 3, 17, 9], [2, 9, 33, 4, 5], [7, 7, 1, 60, 12, 3, 2]]


def test_sampling_values_share_one_program(target):
  """Temperatures and top-p values are traced: one program for all sampled configs with top-p,
  one more without it, one for greedy, one per top-k."""
  drafter = drafters.build("prompt_lookup", target)
  kw = dict(max_new_tokens=12, drafter=drafter, eos_token_id=[])
  decoding.release_compiled()
  with count_compiles() as seen:
    for temperature in (0.3, 0.7, 1.0, 1.6):
      for top_p in (0.5, 0.9):
        decoding.generate(target, PROMPTS[:1], temperature=temperature, top_p=top_p, **kw)
    assert len(seen) == 1
    for temperature in (0.5, 1.0):
      decoding.generate(target, PROMPTS[:1], temperature=temperature, **kw)
    assert len(seen) == 2
    decoding.generate(target, PROMPTS[:1], **kw)
    decoding.generate(target, PROMPTS[:1], temperature=0.5, top_k=5, **kw)
    decoding.generate(target, PROMPTS[:1], temperature=0.9, top_k=5, **kw)
    assert len(seen) == 4


def test_a_new_temperature_changes_the_draws_not_the_program(target):
  """The traced temperature is really used: the same seed at two temperatures draws differently,
  and the same temperature twice draws the same tokens."""
  kw = dict(max_new_tokens=24, eos_token_id=[], seed=1)
  hot = decoding.generate(target, PROMPTS[:1], temperature=2.0, **kw).tokens
  cold = decoding.generate(target, PROMPTS[:1], temperature=0.2, **kw).tokens
  assert hot != cold
  assert decoding.generate(target, PROMPTS[:1], temperature=2.0, **kw).tokens == hot


def test_bucket_lengths():
  """Powers of two, and from 128 on their midpoints too: a long prompt pads by less than half,
  a short one to at most twice its length (at least 16), and the context caps every bucket."""
  buckets = decoding.bucket_lengths(2048)
  assert buckets == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
  for n in range(1, 2049):
    b = decoding.bucket_length(n, 2048)
    assert b in buckets and b >= n and not any(n <= c < b for c in buckets)
    assert b < 1.5 * n if n > 128 else b <= max(2 * n, 16)
  assert decoding.bucket_lengths(100) == [16, 32, 64, 100]
  assert decoding.bucket_length(130, 150) == 150 and decoding.bucket_length(200, 150) == 200


def test_prompt_lengths_in_a_bucket_share_one_program(target):
  """Prompts of 129 to 192 tokens pad to the 192 bucket (one program); 193 takes the next."""
  decoding.release_compiled()
  rs = np.random.RandomState(0)
  kw = dict(max_new_tokens=4, eos_token_id=[])
  with count_compiles() as seen:
    for n in (129, 160, 192):
      decoding.generate(target, [rs.randint(0, 64, n).tolist()], **kw)
    assert len(seen) == 1
    decoding.generate(target, [rs.randint(0, 64, 193).tolist()], **kw)
    assert len(seen) == 2


def test_generation_lengths_in_a_bucket_share_one_program(target):
  """max_new_tokens 17..32 share the 32 bucket; each call still stops at its own length, and a
  shorter greedy generation is a prefix of a longer one."""
  decoding.release_compiled()
  kw = dict(eos_token_id=[])
  with count_compiles() as seen:
    outs = {n: decoding.generate(target, PROMPTS[:1], max_new_tokens=n, **kw).tokens[0]
            for n in (17, 24, 32)}
    assert len(seen) == 1
    decoding.generate(target, PROMPTS[:1], max_new_tokens=33, **kw)
    assert len(seen) == 2
  assert {n: len(t) for n, t in outs.items()} == {17: 17, 24: 24, 32: 32}
  assert outs[32][:17] == outs[17] and outs[32][:24] == outs[24]


def test_batch_sizes_in_a_bucket_share_one_program(target):
  """Batches of 3 and 4 rows run one program (3 is padded with a finished row); every row's
  output is the one it gets alone."""
  decoding.release_compiled()
  alone = [decoding.generate(target, [p], max_new_tokens=10, eos_token_id=[]).tokens[0]
           for p in PROMPTS]
  with count_compiles() as seen:
    three = decoding.generate(target, PROMPTS, max_new_tokens=10, eos_token_id=[])
    four = decoding.generate(target, PROMPTS + PROMPTS[:1], max_new_tokens=10, eos_token_id=[])
  assert len(seen) == 1
  assert three.tokens == alone and four.tokens == alone + alone[:1]
  assert three.stats.row_calls == four.stats.row_calls[:3]
  assert decoding.batch_rows(3) == 4 and decoding.batch_rows(5) == 8


@pytest.mark.parametrize("top_p", [0.9, 0.8, 0.5, 0.1])
def test_traced_top_p_drops_exactly_what_the_python_value_drops(top_p):
  """1 - top_p is formed in double precision before it is traced, so the support under jit is
  the eager one (1 - float32(top_p) would move the boundary)."""
  logits = jax.random.normal(jax.random.key(0), (64, 256)) * 3.0
  cfg = SamplingConfig(temperature=0.8, top_p=top_p)
  eager = process_logits(logits, cfg)
  traced = jax.jit(process_logits)(logits, cfg)
  np.testing.assert_array_equal(np.isfinite(eager), np.isfinite(traced))
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(traced))


def test_sampling_config_pytree_keeps_its_mode():
  leaves, treedef = jax.tree.flatten(SamplingConfig(0.7, 3, 0.9))
  assert len(leaves) == 2 and leaves[0] == 0.7
  assert jax.tree.leaves(SamplingConfig()) == []  # greedy: nothing traced
  back = jax.tree.unflatten(treedef, [jnp.float32(1.5), jnp.float32(0.25)])
  assert back.mode == SamplingConfig(1.5, 3, 0.75).mode and back.top_k == 3
  assert float(back.top_p) == 0.75 and not back.greedy and back.nucleus


_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from specjax import compile_cache, decoding, drafters
    from tests.helpers import tiny_targets as tt
    print("cache:", compile_cache.enable())
    target = tt.scaled_target(tt.config(64), seed=3)
    drafter = drafters.build("prompt_lookup", target)
    r = decoding.generate(target, [[5, 17, 3, 8]], max_new_tokens=8, drafter=drafter,
                          eos_token_id=[])
    print("tokens:", r.tokens[0])
""")


def _run(cache_dir) -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, SPECJAX_COMPILE_CACHE=str(cache_dir))
  out = subprocess.run([sys.executable, "-c", _SCRIPT.format(root=root)], env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _entries(folder) -> set[str]:
  return {name for name in os.listdir(folder) if not name.startswith(".")}


def test_persistent_cache_serves_a_second_process(tmp_path):
  """The first process writes its programs to the cache folder; a second one running the same
  generation writes nothing new (every program came from the folder) and prints the same
  tokens."""
  folder = tmp_path / "cache"
  first = _run(folder)
  written = _entries(folder)
  assert f"cache: {folder}" in first
  assert any("generate_program" in name for name in written), written
  second = _run(folder)
  assert _entries(folder) == written
  assert first.splitlines()[-1] == second.splitlines()[-1]


def test_compile_cache_settings(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "off")
  assert compile_cache.default_dir() is None and compile_cache.enable() is None
  monkeypatch.setenv("SPECJAX_COMPILE_CACHE", str(tmp_path / "here"))
  assert compile_cache.default_dir() == str(tmp_path / "here")
  monkeypatch.delenv("SPECJAX_COMPILE_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.default_dir() == str(tmp_path / "xdg" / "specjax" / "jax_compile")
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  with pytest.raises(ValueError, match="compilation cache folder .* cannot be created"):
    compile_cache.enable(blocker / "sub")


def test_entry_point_flags():
  """Every entry point has `--compile-cache DIR` and `--no-compile-cache`, not both at once."""
  from specjax import cli
  parser = cli.config_parser("x", default_config="configs/benchmark.py")
  args = parser.parse_args(["--no-compile-cache"])
  assert compile_cache.from_args(args) is None
  assert parser.parse_args(["--compile-cache", "somewhere"]).compile_cache == "somewhere"
  with pytest.raises(SystemExit):
    parser.parse_args(["--no-compile-cache", "--compile-cache", "somewhere"])
