"""JAX's persistent compilation cache, on by default for the experiment entry points.

Every program `generate`, the profiler and the trainers compile is written to a cache folder;
a later run of the same program with the same shapes, shardings, jax version and flags loads it
instead of compiling again (on 2 CPU cores a decode program costs 10-20 s to compile). The
entry points call `from_args` after parsing; a library user calls `enable()` once, before the
first compilation.

Where it lives, in order: `--compile-cache DIR`, `$SPECJAX_COMPILE_CACHE`, else
`$XDG_CACHE_HOME/specjax/jax_compile` (~/.cache by default). `--no-compile-cache` (or
`SPECJAX_COMPILE_CACHE=off`) turns it off. The folder is trusted like code: whoever can write to
it can run programs in your process, so keep it private to you.
"""

from __future__ import annotations

import argparse
import os

import jax

ENV = "SPECJAX_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "none")


def default_dir() -> str | None:
  """`$SPECJAX_COMPILE_CACHE` (None when it says off), else the user cache folder."""
  env = os.environ.get(ENV)
  if env is not None and env.strip().lower() in OFF:
    return None
  if env:
    return os.path.abspath(os.path.expanduser(env))
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return os.path.abspath(os.path.expanduser(os.path.join(cache, "specjax", "jax_compile")))


def enable(path: str | os.PathLike | None = None) -> str | None:
  """Turns the persistent cache on in `path` (default: `default_dir()`); returns the folder, or
  None when the environment turned it off. Every program is cached, however small or quick to
  compile: the small ones add up on a slow machine. A folder that cannot be created or written
  is a ValueError naming it."""
  folder = default_dir() if path is None else os.path.abspath(os.path.expanduser(os.fspath(path)))
  if folder is None:
    return None
  from specjax import files
  try:
    files.check_output_dir(folder, "compilation cache folder")
  except ValueError as e:
    raise ValueError(f"{e} (pass --compile-cache DIR or --no-compile-cache)") from None
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """`--compile-cache DIR` and `--no-compile-cache`."""
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--compile-cache", default=None, metavar="DIR",
                     help=f"persistent compilation cache folder (default: ${ENV}, else "
                     "~/.cache/specjax/jax_compile)")
  group.add_argument("--no-compile-cache", action="store_true",
                     help="compile every program anew (no persistent cache)")


def from_args(args: argparse.Namespace) -> str | None:
  """Applies the parsed `add_arguments` flags: the cache folder in use, or None."""
  if getattr(args, "no_compile_cache", False):
    return None
  return enable(getattr(args, "compile_cache", None))
