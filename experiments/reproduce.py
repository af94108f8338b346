"""Reproduce a results table: `methods`, `sampling`, `depth`, `theory`, `budget`, `peers`,
`batch` or `all`.

  python -m experiments.reproduce methods
  python -m experiments.reproduce all                               # every table, one job
  python -m experiments.reproduce depth --set num_prompts=8 --set max_new_tokens=128
  python -m experiments.reproduce methods --set methods_table.temperatures=1 \
      --set methods_table.top_p=1
  python -m experiments.reproduce methods --set target=DIR --set drafter.eagle3=DIR
  python -m experiments.reproduce budget --config my_reproduce.py --out out/mine

Writes OUT/<table>.md, OUT/<table>.json and OUT/<table>.png (OUT: the config's `out`,
out/reproduce by default), prints each table and how long it took. What each table shows:
`specjax.lab.tables` and the README's "Reproducing tables". Each table's own fields are its
config's: --set theory_table.lengths=1,2,4 (`--help` lists them).
"""

from __future__ import annotations

from specjax import cli, distributed
from specjax.lab.reproduce import ReproduceConfig, run
from specjax.lab.tables import TABLES


@cli.usage_errors
def main(argv=None):
  parser = cli.config_parser(__doc__.splitlines()[0], default_config="configs/reproduce.py",
                             config_class=ReproduceConfig)
  parser.add_argument("table", choices=[*TABLES, "all"])
  parser.add_argument("--out", default=None, help="output folder (default: the config's)")
  args = parser.parse_args(argv)
  cfg = cli.load_from_args(args, [] if args.out is None else [f"out={args.out}"])
  names = list(TABLES) if args.table == "all" else [args.table]
  return run(names, cfg, echo=print if distributed.is_main_process() else lambda _: None)


if __name__ == "__main__":
  main()
