"""`towerflow export RUN_DIR --out DIR [--step N]`: a run's checkpoint as a plain PyTorch state_dict and Parquet tables."""

from __future__ import annotations

import sys

PROG = "towerflow export"


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="a run's checkpoint as a plain PyTorch state_dict and Parquet (id, vector) tables",
        description="Read the newest intact checkpoint of RUN_DIR (or that of --step), written with any number of "
                    "ps tasks and any placement or partition, and write DIR/model.pt (the model's state_dict, tables "
                    "included: model.load_state_dict(torch.load(...)) in plain PyTorch), DIR/tables/NAME/*.parquet "
                    "(each table's (id, vector) rows) and, for hash tables, DIR/hash_tables.pt with "
                    "DIR/hash_lookup.py. The folder appears whole or not at all (docs/serving.md).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's --logdir (where its ckpt-*.json are)")
    p.add_argument("--out", required=True, metavar="DIR", help="the export folder (new, empty, or an export with "
                   "--overwrite)")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of global step N (default: "
                   "the newest intact one)")
    p.add_argument("--overwrite", action="store_true", help="replace an export already in DIR (once the new one is "
                   "complete)")
    p.set_defaults(func=run)


def run(args) -> int:
    from towerflow.errors import TowerflowError
    from towerflow.export import export_run

    try:
        info = export_run(args.run_dir, args.out, step=args.step, overwrite=args.overwrite)
    except (TowerflowError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    rows = ", ".join(f"{name} {t['rows']}x{t['dim']}" for name, t in info.tables.items()) or "no tables"
    print(f"exported step {info.step} ({info.num_ps} ps tasks) to {info.out}: {rows}")
    return 0
