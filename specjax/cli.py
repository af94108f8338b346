"""The command line shared by the experiment entry points: `--config`, `--set`, `--stop-after`,
the multi-process flags `--coordinator`, `--num-processes`, `--process-id`, the CPU devices
`--cpu-devices N|auto` (`specjax.distributed`) and the persistent compilation cache's
`--compile-cache DIR` / `--no-compile-cache` (`specjax.compile_cache`, on by default).

Entry points without a config that lay a target on a mesh take `--mesh` (`add_mesh_argument`,
`mesh_from_args`).

A config problem (a bad `--set` item, an unknown field, a value the config refuses) or
inconsistent multi-process flags are a usage error: one line `error: <message>` on stderr and
exit status 2, before any work starts. `load_from_args` joins the processes of a multi-process
run once the config is valid and before any JAX computation; only process 0 prints the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from specjax import compile_cache, distributed, sharding
from specjax.config_utils import load_config


def config_parser(description: str, *, default_config: str | None = None,
                  stop_after: bool = False) -> argparse.ArgumentParser:
  """An ArgumentParser with `--config` (required without a default), repeatable `--set`, the
  multi-process flags (`distributed.add_arguments`) and, for resumable trainers,
  `--stop-after`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--config", default=default_config, required=default_config is None,
                      help="configs/<name>.py, configs.<name> or <name>"
                      + (f" (default: {default_config})" if default_config else ""))
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="override a config field, e.g. --set optim.total_steps=100")
  if stop_after:
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many steps of this run (checkpointed)")
  distributed.add_arguments(parser)
  compile_cache.add_arguments(parser)
  return parser


def resolve_config_path(name_or_path: str) -> str:
  """A config file path that does not exist from the working directory is looked up from the
  root holding the `configs` package, so `--config configs/x.py` works from anywhere."""
  if not (name_or_path.endswith(".py") or os.sep in name_or_path):
    return name_or_path  # a module name: imported, not opened
  if os.path.isabs(name_or_path) or os.path.exists(name_or_path):
    return name_or_path
  import configs
  root = os.path.dirname(os.path.dirname(os.path.abspath(configs.__file__)))
  candidate = os.path.join(root, name_or_path)
  return candidate if os.path.exists(candidate) else name_or_path


def load_from_args(args: argparse.Namespace, extra_overrides: Sequence[str] = ()) -> Any:
  """`args.config` with `args.set` and `extra_overrides` applied, then this process joined to
  the multi-process run its flags (or the environment) describe, a no-op for a single process,
  and the persistent compilation cache turned on unless `--no-compile-cache`. A config error or
  inconsistent multi-process settings exit (2). The config comes first, so a bad one fails at
  once instead of after waiting for the other processes."""
  try:
    cfg = load_config(resolve_config_path(args.config), [*args.set, *extra_overrides])
  except (ValueError, ImportError) as e:
    fail(str(e))
  # A config whose mesh is "auto" spreads the model over the host's cores: one CPU device each
  # (`--cpu-devices` or the environment may say otherwise; GPU and TPU hosts are unaffected).
  auto = getattr(cfg, "mesh", None) == sharding.AUTO
  try:
    distributed.from_args(args, cpu_devices=sharding.AUTO if auto else None)
    compile_cache.from_args(args)
  except ValueError as e:
    fail(str(e))
  return cfg


def add_mesh_argument(parser: argparse.ArgumentParser, default: str | None = sharding.AUTO,
                      help_default: str = "auto") -> None:
  """`--mesh`: where a target is laid out: 'auto' (over every core or device it divides into,
  `sharding.auto_mesh`), 'none' (one device) or a spec such as 'dp=1,tp=2'."""
  parser.add_argument("--mesh", default=default,
                      help="the target's mesh: auto (over every core or device it divides into), "
                           "none (one device) or a spec such as dp=1,tp=2 "
                           f"(default: {help_default})")


def mesh_from_args(args: argparse.Namespace) -> str | None:
  """The mesh `--mesh` names (None for one device), with JAX started on one CPU device per core
  for 'auto' (`distributed.initialize`), then the compilation cache on (`compile_cache.from_args`):
  call it before any JAX computation."""
  mesh = None if args.mesh is None or args.mesh.lower() == "none" else args.mesh
  distributed.initialize(cpu_devices=sharding.AUTO if mesh == sharding.AUTO else None)
  compile_cache.from_args(args)
  return mesh


def fail(message: str) -> NoReturn:
  """Prints `error: <message>` as one line on stderr and exits with status 2 (a usage error)."""
  print("error: " + " ".join(message.split()), file=sys.stderr)
  sys.exit(2)


def train_main(description: str, train: Callable[..., dict[str, Any]],
               report: Sequence[str], *, default_config: str | None = None,
               argv: Sequence[str] | None = None) -> dict[str, Any]:
  """The entry point of a resumable trainer: `--config`, `--set`, `--stop-after`; runs
  `train(cfg, stop_after=...)` (a summary with "finished", "step" and, when finished,
  "metadata" and "export_dir") and prints the `report` fields of the metadata, or where the run
  stopped; in a multi-process run only process 0 prints."""
  parser = config_parser(description, default_config=default_config, stop_after=True)
  args = parser.parse_args(argv)
  cfg = load_from_args(args)
  summary = train(cfg, stop_after=args.stop_after)
  if not distributed.is_main_process():
    return summary
  if summary["finished"]:
    print(json.dumps({k: summary["metadata"][k] for k in report}, indent=2))
    print(f"exported to {summary['export_dir']}")
  else:
    print(f"stopped at step {summary['step']} of {cfg.optim.total_steps}; run again to resume")
  return summary
