"""The main job: tau, tokens/s and speedup of every method on the embedded default.

  python -m experiments.benchmark [--config configs/benchmark.py] [--out DIR] [--set key=value]
  python -m experiments.benchmark --set mesh=dp=2,tp=4     # on a device mesh: also bytes/device
  python -m experiments.benchmark --set profile=false      # tau, tokens/s, speedup only: quicker

Writes DIR/results.json (one record per method and dataset), DIR/results.md and PNG plots.
A multi-process run (`--coordinator HOST:PORT --num-processes N --process-id I` on each process)
writes and prints them from process 0 only.
"""

from __future__ import annotations

import json
import os

from specjax import cli, distributed, provenance
from specjax.lab.benchmark import BenchmarkConfig, run
from specjax.lab.report import FOOTNOTE, layout_lines, measured_with


@cli.usage_errors
def main(argv=None):
  parser = cli.config_parser(__doc__.splitlines()[0], default_config="configs/benchmark.py",
                             config_class=BenchmarkConfig)
  parser.add_argument("--out", default=None, help="output folder (default: the config's)")
  args = parser.parse_args(argv)
  cfg = cli.load_from_args(args, [] if args.out is None else [f"out={args.out}"])
  records = run(cfg, report=print)  # each dataset's table as soon as it is done
  if not distributed.is_main_process():
    return  # process 0 wrote the results and printed the tables
  with open(os.path.join(cfg.out, "results.json")) as f:
    saved = json.load(f)
  print()
  print(measured_with(provenance.header(saved["provenance"])))
  if saved.get("layout"):
    print("\n".join(layout_lines(saved["layout"])))
  if cfg.profile:
    print(FOOTNOTE)
  bad = [f"{r.method}/{r.dataset}" for r in records
         if cfg.temperature == 0 and not r.matches_autoregressive]
  if bad:
    print(f"WARNING: greedy outputs differ from autoregressive for {bad}")
  print(f"results in {cfg.out}/results.json, results.md, acceptance_by_depth.png, speedup.png")


if __name__ == "__main__":
  main()
