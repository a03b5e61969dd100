"""Write the synthetic click log as files to train from: `python -m towerflow.data.write_ctr DIR`.

    python -m towerflow.data.write_ctr /tmp/ctr --format criteo --rows 100000 --files 8
    towerflow launch --ps 1 --workers 2 examples/ctr_ps.py --data /tmp/ctr --rows 100000

DIR/train gets `--files` files of `--records-per-file` records, DIR/test the held-out set; the
planted model (`towerflow.data.synthetic_ctr` with the same --rows and --seed) says how good an AUC
can get. Criteo TSV stores the dense features as counts, so they come back quantized.
"""

from __future__ import annotations

import argparse
import sys

from towerflow.data.ctr import synthetic_ctr
from towerflow.data.ctr_files import write_ctr_files
from towerflow.errors import TowerflowError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m towerflow.data.write_ctr", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("directory")
    p.add_argument("--format", default="parquet", choices=["parquet", "arrow", "criteo"])
    p.add_argument("--rows", type=int, default=100_000, help="rows (ids) per table, as examples/ctr_ps.py --rows")
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--records-per-file", "--records_per_file", type=int, default=16384)
    p.add_argument("--row-group", "--row_group", type=int, default=4096, help="records per Parquet row group / Arrow batch")
    p.add_argument("--test-size", "--test_size", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0, help="the planted model's seed, as examples/ctr_ps.py --seed")
    args = p.parse_args(argv)
    try:
        data = synthetic_ctr(args.rows, seed=args.seed, test_size=args.test_size)
        paths, test = write_ctr_files(data, args.directory, args.format, files=args.files,
                                      records_per_file=args.records_per_file, row_group=args.row_group)
    except TowerflowError as e:
        print(f"write_ctr: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(paths)} {args.format} files of {args.records_per_file} records in {args.directory}/train, "
          f"{args.test_size} held-out records in {test}; best possible AUC {data.best_auc:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
