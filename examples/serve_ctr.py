"""Score examples/ctr_ps.py's held-out records with its model out of training: an export, or the published rows.

    towerflow launch --ps 2 --workers 2 --logdir RUN --publish-every 10 examples/ctr_ps.py --rows 100000 \\
        --save-checkpoint-steps 100
    towerflow export RUN --out EXPORT
    python examples/serve_ctr.py --model EXPORT --rows 100000          # the exported state_dict, in plain PyTorch
    python examples/serve_ctr.py --follow RUN/publish --rows 100000    # the rows as published, followed until the end

It takes ctr_ps.py's data flags (`--rows`, `--tables`, `--dim`, `--seed`, `--test-size`, `--data`, `--schema`, ...),
so it scores the same records the chief did, and prints `test auc: A`. With `--follow` the model is rebuilt from an
`EmbeddingStore` of the publications (dense shards and table rows) each time new ones arrive, and it stops once
every ps task has published the run's last global step (`--steps`) or nothing new came for `--settle` seconds.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ctr_ps import DLRM, evaluate, parse_args  # noqa: E402

from towerflow.data import Schema, read_all, synthetic_ctr  # noqa: E402


def build(args):
    schema = Schema.load(args.schema) if args.schema else None
    if schema is not None:
        return DLRM.for_schema(schema, args.dim), schema
    return DLRM([args.rows] * args.tables, 13, args.dim), None


def test_records(args, schema):
    if args.data:
        rows = None if schema else [args.rows] * args.tables
        return read_all(os.path.join(args.data, "test"), args.format, rows, schema=schema)
    return synthetic_ctr(args.rows, args.tables, seed=args.seed, test_size=args.test_size).test_set()


def from_store(model, store) -> None:
    """The model's values from the published rows: dense shards put back whole, every table row by row."""
    dense = store.dense()
    state = model.state_dict()
    for name in state:
        parts = sorted((k for k in dense if k == name or k.startswith(name + "/part_")),
                       key=lambda k: int(k.rsplit("_", 1)[1]) if "/part_" in k else 0)
        if parts:
            state[name] = torch.cat([dense[k] for k in parts]) if len(parts) > 1 else dense[parts[0]]
    for table in store.tables:
        weight = state[f"{table}.weight"]
        state[f"{table}.weight"] = store.lookup(table, torch.arange(weight.shape[0])).to(weight.dtype)
    model.load_state_dict(state)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="EXPORT_DIR", help="an export of the run (towerflow export RUN --out DIR)")
    source.add_argument("--follow", metavar="PUBLISH_DIR", help="the run's publications (--publish-every; RUN/publish)")
    p.add_argument("--settle", type=float, default=30.0, help="--follow: stop when nothing new came for this long")
    ours, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    model, schema = build(args)
    test_set = test_records(args, schema)
    if ours.model:
        model.load_state_dict(torch.load(os.path.join(ours.model, "model.pt")))
        print(f"test auc: {evaluate(model, test_set, 'cpu'):.4f}", flush=True)
        return
    from towerflow.serving import EmbeddingStore

    store = EmbeddingStore(ours.follow)
    last_news = time.monotonic()
    while True:
        if store.refresh():
            last_news = time.monotonic()
            from_store(model, store)
            step = min(store.global_steps.values())
            print(f"global step {step}: test auc: {evaluate(model, test_set, 'cpu'):.4f}", flush=True)
            if step >= args.steps:
                break
        elif time.monotonic() - last_news > ours.settle:
            break
        time.sleep(1.0)
    print(f"test auc: {evaluate(model, test_set, 'cpu'):.4f}", flush=True)


if __name__ == "__main__":
    main()
