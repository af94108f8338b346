"""`specjax.cli`: the experiments' command line reports a config problem as a usage error (one
line on stderr, exit status 2, no traceback) before any work starts, from any directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specjax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, cwd):
  # PYTHONPATH: this checkout's packages, whatever copy is installed.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
  return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.parametrize("override,message", [
    ("optim.total_steps=100", r"warmup_steps (100) must be < total_steps (100)"),
    ("nosuchfield=1", "has no field 'nosuchfield'"),
])
def test_config_errors_are_one_line_and_exit_2(tmp_path, override, message):
  """Run from an empty directory: `configs/target_stdlib.py` is found from the package root, and
  the error comes before any training or data preparation (nothing is written)."""
  r = _run(["experiments.train_target", "--config", "configs/target_stdlib.py",
            "--set", override], cwd=tmp_path)
  assert r.returncode == 2, r.stderr
  lines = [line for line in r.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
  assert r.stdout == "" and os.listdir(tmp_path) == []


def test_resolve_config_path(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  found = cli.resolve_config_path("configs/target_stdlib.py")
  assert os.path.isfile(found) and found.endswith(os.path.join("configs", "target_stdlib.py"))
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "target_stdlib.py").write_text("")
  assert cli.resolve_config_path("configs/target_stdlib.py") == "configs/target_stdlib.py"
  assert cli.resolve_config_path("target_stdlib") == "target_stdlib"  # a module name
  assert cli.resolve_config_path("configs/none.py") == "configs/none.py"  # load_config names it


def test_load_from_args_fails_as_a_usage_error(capsys):
  parser = cli.config_parser("test", default_config="configs/target_stdlib.py", stop_after=True)
  args = parser.parse_args(["--set", "seq_len"])
  assert args.stop_after is None
  with pytest.raises(SystemExit) as e:
    cli.load_from_args(args)
  assert e.value.code == 2
  assert capsys.readouterr().err == (
      "error: override 'seq_len' is not of the form dotted.path=value\n")
  cfg = cli.load_from_args(parser.parse_args(["--set", "seed=3"]), ["log_every=5"])
  assert (cfg.seed, cfg.log_every) == (3, 5)


def test_tune_tree_save_needs_an_explicit_path(capsys):
  """`tune_tree --save` writes into a drafter folder: without --path it refuses (a usage error
  naming --path) before any sweep, so the shipped folders change only when named."""
  from experiments import tune_tree
  with pytest.raises(SystemExit) as e:
    tune_tree.main(["--method", "eagle", "--save"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --save writes into a drafter folder: name it with --path")
  assert "specjax/assets/eagle" in err


@pytest.mark.parametrize("module,config", [
    ("experiments.train_target", "configs/target_stdlib.py"),
    ("experiments.benchmark", "configs/benchmark.py"),
])
def test_multi_process_flags_are_checked_before_any_work(tmp_path, module, config):
  """The entry points take --coordinator / --num-processes / --process-id; inconsistent ones
  are a usage error (one line, status 2) before any JAX work or file is written."""
  r = _run([module, "--config", config, "--num-processes", "2", "--process-id", "0"],
           cwd=tmp_path)
  assert r.returncode == 2, r.stderr
  lines = [line for line in r.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: 2 processes need a coordinator"), r.stderr
  assert r.stdout == "" and os.listdir(tmp_path) == []


def test_config_parser_has_the_multi_process_flags(capsys, monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  parser = cli.config_parser("test", default_config="configs/target_stdlib.py")
  args = parser.parse_args(["--coordinator", "10.0.0.1:1234", "--num-processes", "2",
                            "--process-id", "1"])
  assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.1:1234", 2, 1)
  cfg = cli.load_from_args(parser.parse_args(["--set", "seed=4"]))  # single process: no-op
  assert cfg.seed == 4
  with pytest.raises(SystemExit) as e:
    cli.load_from_args(parser.parse_args(["--num-processes", "2", "--process-id", "2"]))
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: process_id 2 (from the arguments) must be [0, 2)"), err
  assert err.count("\n") == 1
