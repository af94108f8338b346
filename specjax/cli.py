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
import copy
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from specjax import compile_cache, config_utils, distributed, sharding
from specjax.config_utils import load_config


class ConfigParser(argparse.ArgumentParser):
  """An ArgumentParser whose `--help` ends with the config's fields: each one's type, range and
  value in the config `--config` names (with any `--set` applied), or, without a config, the
  defaults of `config_class`."""

  def __init__(self, *args, config_class: type | None = None, **kwargs):
    super().__init__(*args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    self.config_class = config_class

  def parse_known_args(self, args=None, namespace=None):
    argv = sys.argv[1:] if args is None else list(args)
    if any(a in ("-h", "--help") for a in argv):
      self.epilog = self._fields_help(argv)
    return super().parse_known_args(argv, namespace)

  def _fields_help(self, argv: Sequence[str]) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=self.get_default("config"))
    pre.add_argument("--set", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    if known.config is None and self.config_class is None:
      return "config fields: name a config with --config to list them"
    try:
      cfg = (load_config(resolve_config_path(known.config), known.set)
             if known.config is not None else self.config_class)
    except (ValueError, ImportError) as e:
      return f"config fields: unavailable ({' '.join(str(e).split())})"
    source = (f"the values of {known.config}" if known.config is not None
              else f"the defaults of {self.config_class.__name__}")
    lines = config_utils.describe_fields(cfg)
    return (f"config fields, with {source} (change one with --set NAME=VALUE; lists are "
            "comma-separated, none clears an optional field):\n"
            + "\n".join(f"  {line}" for line in lines))


def config_parser(description: str, *, default_config: str | None = None,
                  stop_after: bool = False, config_class: type | None = None
                  ) -> argparse.ArgumentParser:
  """An ArgumentParser with `--config` (required without a default), repeatable `--set`, the
  multi-process flags (`distributed.add_arguments`) and, for resumable trainers,
  `--stop-after`; its `--help` lists the config's fields (`ConfigParser`)."""
  parser = ConfigParser(description=description, config_class=config_class)
  parser.set_defaults(config_class=config_class)  # what `load_from_args` checks the config is
  parser.add_argument("--config", default=default_config, required=default_config is None,
                      help="configs/<name>.py, configs.<name> or <name>"
                      + (f" (default: {default_config})" if default_config else ""))
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="override a config field, e.g. --set optim.total_steps=100")
  if stop_after:
    parser.add_argument("--stop-after", type=positive_int, default=None, metavar="STEPS",
                        help="stop after this many steps of this run (checkpointed)")
  distributed.add_arguments(parser)
  compile_cache.add_arguments(parser)
  return parser


# -- the command line of the entry points without a config -----------------------------------


_NO_HELP = "\x00"


class _TypesAndDefaults(argparse.RawDescriptionHelpFormatter):
  """Every option's help ends with what it takes and its default: `(int >= 1; default: 8)`."""

  def _format_action(self, action: argparse.Action) -> str:
    if not action.help and action.option_strings and action.nargs != 0:
      action = copy.copy(action)
      action.help = _NO_HELP  # an option without help still shows its type and default
    return super()._format_action(action)

  def _get_help_string(self, action: argparse.Action) -> str:
    text = (action.help or "").replace(_NO_HELP, "").strip()
    if action.option_strings and action.nargs != 0 and "%(default)" not in text:
      kind = getattr(action.type, "kind", None) or (
          " | ".join(map(str, action.choices)) if action.choices else
          getattr(action.type, "__name__", "str"))
      default = "none" if action.default is None else (
          ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple))
          else action.default)
      said = "default" in text.lower()  # the help already says what the default means
      suffix = f"({kind})" if said else f"({kind}; default: {default})"
      text = f"{text} {suffix}".strip().replace("%", "%%")
    return text


def tool_parser(description: str) -> argparse.ArgumentParser:
  """The parser of an entry point without a config (the bench_* tools, tune_tree,
  compare_drafters): its `--help` gives each option's type and default."""
  return argparse.ArgumentParser(description=description, formatter_class=_TypesAndDefaults)


def _typed(kind: str, parse: Callable[[str], Any], ok: Callable[[Any], bool]):
  """An argparse `type` that parses with `parse` and refuses what `ok` rejects, naming `kind`."""

  def convert(text: str) -> Any:
    try:
      value = parse(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
    if not ok(value):
      raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}")
    return value

  convert.kind = kind
  convert.__name__ = kind
  return convert


def _int_list(text: str) -> list[int]:
  items = [t.strip() for t in text.split(",")]
  if not all(items):
    raise ValueError(text)
  return [int(t) for t in items]


positive_int = _typed("an int >= 1", int, lambda n: n >= 1)
non_negative_int = _typed("an int >= 0", int, lambda n: n >= 0)
seed = _typed("an int in [0, 2**32)", int, lambda n: 0 <= n < 2**32)
positive_ints = _typed("comma-separated ints >= 1", _int_list,
                       lambda xs: bool(xs) and all(x >= 1 for x in xs))


def names(text: str) -> list[str]:
  """A comma-separated list of names, none of them empty."""
  items = [t.strip() for t in text.split(",")]
  if not all(items):
    raise argparse.ArgumentTypeError(f"must be comma-separated names, got {text!r}")
  return items


names.kind = "comma-separated names"


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
  wanted = getattr(args, "config_class", None)
  if wanted is not None and not isinstance(cfg, wanted):
    fail(f"{args.config} makes a {type(cfg).__name__}; this entry point runs a "
         f"{wanted.__name__} (its configs: `--help` lists the fields)")
  try:
    distributed.from_args(args, cpu_devices=_cpu_devices_for(getattr(cfg, "mesh", None), args))
    compile_cache.from_args(args)
  except ValueError as e:
    fail(str(e))
  return cfg


def _cpu_devices_for(mesh: str | None, args: argparse.Namespace) -> int | str | None:
  """The CPU devices a config's mesh needs (`--cpu-devices` or the environment may say
  otherwise; GPU and TPU hosts are unaffected). "auto" spreads the model over the host's cores,
  one CPU device each; an explicit spec such as "dp=1,tp=2" gets the devices it names, since JAX
  would start a CPU host with one."""
  if mesh is None:
    return None
  if mesh == sharding.AUTO:
    return sharding.AUTO
  single = (getattr(args, "num_processes", None) or int(
      os.environ.get(distributed.ENV_NUM_PROCESSES) or 1)) == 1
  return sharding.spec_devices(mesh) if single and distributed.cpu_devices_free() else None


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
  try:
    distributed.initialize(cpu_devices=_cpu_devices_for(mesh, args))
  except ValueError as e:
    fail(f"--mesh {mesh}: {e}")
  compile_cache.from_args(args)
  return mesh


def check_out_file(parser: argparse.ArgumentParser, path: str | None) -> None:
  """A tool's `--out` file, checked before it measures: not inside the shipped assets, its
  folder creatable and writable, not itself a folder (a usage error otherwise)."""
  if path is None:
    return
  from specjax import files
  try:
    files.check_output_file(path, "--out file")
  except ValueError as e:
    parser.error(str(e))


def usage_errors(main: Callable[..., Any]) -> Callable[..., Any]:
  """Decorates an entry point's `main`: a ValueError it raises (what the library refuses, named
  by its message: a folder that does not load, an option a drafter does not take, a prompt
  longer than the context) is printed as one line `error: <message>` with exit status 2; an
  interruption (Ctrl-C) as one line too, exit status 130, without JAX's traceback. Every file
  is replaced whole (`specjax.files`), so what an interrupted run wrote stays readable."""

  @functools.wraps(main)
  def wrapped(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except ValueError as e:
      fail(str(e))
    except KeyboardInterrupt:
      print("\ninterrupted: files already written are whole; a training run resumes from its "
            "last checkpoint when run again", file=sys.stderr)
      sys.exit(130)

  return wrapped


def fail(message: str) -> NoReturn:
  """Prints `error: <message>` as one line on stderr and exits with status 2 (a usage error)."""
  print("error: " + " ".join(message.split()), file=sys.stderr)
  sys.exit(2)


def train_main(description: str, train: Callable[..., dict[str, Any]],
               report: Sequence[str], *, default_config: str | None = None,
               config_class: type | None = None, argv: Sequence[str] | None = None
               ) -> dict[str, Any]:
  """The entry point of a resumable trainer: `--config`, `--set`, `--stop-after`,
  `--overwrite-shipped` (an export_dir inside specjax/assets is refused without it: exit 2
  before training); runs `train(cfg, stop_after=..., overwrite_shipped=...)` (a summary with
  "finished", "step" and, when finished, "metadata" and "export_dir") and prints the `report`
  fields of the metadata, or where the run stopped; in a multi-process run only process 0
  prints. A run that reaches a non-finite loss, gradient norm or parameters
  (`loop.NonFiniteError`) prints `error: <message>` as one line on stderr, naming the step and
  the checkpoint a rerun resumes from, and exits with status 1; the resumed-from step is said by
  the trainer's progress output when it restores a checkpoint."""
  parser = config_parser(description, default_config=default_config, stop_after=True,
                         config_class=config_class)
  from specjax import assets
  parser.add_argument(assets.OVERWRITE_FLAG, action="store_true",
                      help="let export_dir replace a shipped folder under specjax/assets")
  args = parser.parse_args(argv)
  cfg = load_from_args(args)
  from specjax.train.loop import NonFiniteError  # here: the optax and orbax imports are heavy
  try:
    summary = train(cfg, stop_after=args.stop_after, overwrite_shipped=args.overwrite_shipped)
  except ValueError as e:  # refused before training starts (a shipped folder, a workdir of
    fail(str(e))           # other settings, a target the config does not fit): a usage error
  except NonFiniteError as e:  # a diverged run: one line, exit 1 (not a usage error's 2)
    if distributed.is_main_process():
      print("error: " + " ".join(str(e).split()), file=sys.stderr)
    sys.exit(1)
  if not distributed.is_main_process():
    return summary
  if summary["finished"]:
    print(json.dumps({k: summary["metadata"][k] for k in report}, indent=2))
    print(f"exported to {summary['export_dir']}")
  else:
    print(f"stopped at step {summary['step']} of {cfg.optim.total_steps}; run again to resume")
  return summary
