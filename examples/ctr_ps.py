"""A DLRM-style click model on Criteo-shaped synthetic data, with sparse embedding tables.

    python examples/ctr_ps.py --rows 100000 --steps 300          # one process
    python examples/ctr_ps.py --rows 1000000 --optimizer adam    # SparseAdam for the tables, Adam for the rest
    towerflow launch --ps 2 --workers 2 examples/ctr_ps.py --rows 1000000                     # async
    towerflow launch --ps 2 --workers 2 --mode sync --replicas-to-aggregate 1 examples/ctr_ps.py --rows 1000000
    towerflow launch --ps 2 --workers 2 --mode ssp --staleness 2 examples/ctr_ps.py --rows 1000000
    towerflow launch --ps 2 --workers 4 --dense allreduce examples/ctr_ps.py   # hybrid: only the tables on the ps
    towerflow launch --workers 2 examples/ctr_ps.py --rows 100000              # all-reduce, tables on every worker
    towerflow launch --ps 1 --workers 2 examples/ctr_ps.py --data DIR --rows 100000   # from Criteo's files
    towerflow launch --ps 2 --workers 2 examples/ctr_ps.py --data DIR --schema schema.json  # any columns
    towerflow launch --ps 2 --workers 2 --logdir RUN --publish-every 10 examples/ctr_ps.py  # rows published as they train

With `--data DIR` the model trains from files instead: DIR/train holds Parquet, Arrow IPC or text
files (CSV, TSV, gzip'd or not), each worker reading its share of them (`strategy.distribute_files`),
and the AUC is measured on every record of DIR/test (Criteo's convention: the last day held out).
Their columns are Criteo's (label, 13 integers, 26 hex categoricals) unless `--schema FILE` declares
them (or `--label NAME` infers them from the first file): the DLRM then has one table per table of the
schema, looked up by its categorical and list columns. `python -m towerflow.data.write_ctr DIR
--format parquet` writes the synthetic data below as such files, its test set included.

The data (towerflow.data.synthetic_ctr) has 13 dense and 26 categorical features whose ids
follow a power law; labels come from a planted model, so the chief can say how close the
trained model gets: `test auc: A (best possible: B)`. Each of the 26 tables is an
`nn.EmbeddingBag(sparse=True)`: a step touches only the rows of the ids in its batch, and
`wire:` compares the bytes that travelled per step with that minimum (those rows, pulled and
pushed, plus the dense parameters both ways).

Under parameter servers (`towerflow launch --ps N`) the tables are built on the meta device
(`strategy.table_device`): their rows live only on the ps tasks, mod-sharded, and a worker
allocates none of them; the row optimizer (`--optimizer`, `ftrl` included) runs there. With
`--logdir D --save-checkpoint-steps K` the chief checkpoints tables and optimizer state, and a
job launched with `--max-restarts 1` survives a killed ps (docs/parameter-server.md). With
`--dense allreduce` (hybrid) only the tables are there: the bottom and top MLPs are replicated on the
workers and all-reduced every step, and `wire:` counts the rows alone (no dense parameter travels to
the ps); a global step is then one step of every worker.
`towerflow export RUN --out DIR` makes the trained model a plain PyTorch state_dict, and
examples/serve_ctr.py scores these records from it, or from the rows `--publish-every` publishes while it
trains (docs/serving.md).

Measured in one process (2-core AMD EPYC, 1 thread), adagrad: --rows 100000 --steps 300 reaches
0.8151 against a best of 0.8228; --rows 1000000 gets within 0.01 of its best in about 200
steps (0.8037 at 100, 0.8140 at 200, 0.8165 at 300; best 0.8223).
"""

import argparse
import itertools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow.data import Schema, auc, read_all, synthetic_ctr
from towerflow.training import save_metrics


class DLRM(nn.Module):
    """Embedding bags per table, a bottom MLP over the dense features, pairwise dot interactions, a top MLP.

    `bottom` and `top` are the hidden widths; the bottom MLP ends at `dim` (so its output can
    be dotted with the embeddings) and the top MLP at one logit. `table_device="meta"` builds
    the tables without memory (for a worker whose tables live on the ps tasks). Each categorical
    feature looks up one table (`feature_tables`: its table's index; by default feature i reads
    table i), and each list feature (`bag_tables`) pools its ids in one: features may share a table.
    `DLRM.for_schema` builds it from a `towerflow.data.Schema`.
    """

    def __init__(self, rows_per_table, num_dense=13, dim=16, bottom=(64,), top=(64,), table_device=None, sparse=True,
                 feature_tables=None, bag_tables=()):
        super().__init__()
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse, device=table_device) for rows in rows_per_table
        )
        for table in self.tables:  # DLRM's init: small rows, so ids never seen in training add ~nothing
            bound = table.num_embeddings ** -0.5
            nn.init.uniform_(table.weight, -bound, bound)  # (a no-op on the meta device)
            table.init_std = bound / 3 ** 0.5  # the same spread where the ps draws the rows
        self.feature_tables = list(range(len(rows_per_table)) if feature_tables is None else feature_tables)
        self.bag_tables = list(bag_tables)
        self.bottom = _mlp([num_dense, *bottom, dim], last_relu=True)
        vectors = len(self.feature_tables) + len(self.bag_tables) + 1
        i, j = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", i * vectors + j, persistent=False)  # the upper triangle, as flat indices
        self.top = _mlp([dim + len(self.pairs), *top, 1], last_relu=False)

    @classmethod
    def for_schema(cls, schema, dim=16, **options):
        """One table per table of the schema (its rows), looked up by its categorical and list columns."""
        names = list(schema.tables)
        missing = [n for n, rows in schema.tables.items() if rows is None]
        if missing:
            raise SystemExit(f"tables {missing} have no rows in the schema: give each categorical its rows")
        return cls([schema.tables[n] for n in names], len(schema.dense), dim,
                   feature_tables=[names.index(c.table_name) for c in schema.categoricals],
                   bag_tables=[names.index(c.table_name) for c in schema.lists], **options)

    def forward(self, dense: torch.Tensor, cats: torch.Tensor, bags=()) -> torch.Tensor:
        """`cats` [B, features]: one id per categorical feature; `bags`: (ids, offsets) per list feature."""
        x = self.bottom(dense)
        vectors = [self.tables[t](cats[:, i : i + 1]) for i, t in enumerate(self.feature_tables)]  # bags of one id
        vectors += [self.tables[t](ids, offsets) for t, (ids, offsets) in zip(self.bag_tables, bags)]
        z = torch.stack([x, *vectors], 1)  # [B, features + 1, dim]
        dots = torch.bmm(z, z.transpose(1, 2)).flatten(1).index_select(1, self.pairs)  # each pair once
        return self.top(torch.cat([x, dots], 1)).squeeze(1)

    def dense_parameters(self):
        """Everything but the tables: the parameters every step reads and updates in full."""
        tables = {id(p) for p in self.tables.parameters()}
        return [p for p in self.parameters() if id(p) not in tables]


def model_inputs(batch):
    """(dense, cats, bags) of a batch: a `Features` of a schema, or Criteo's (dense, cats, labels) tuple."""
    if isinstance(batch, tuple):
        return batch[0], batch[1], ()
    return batch.dense, batch.ids, tuple(batch[name] for name in batch.names.lists)


def labels_of(batch):
    return batch[2] if isinstance(batch, tuple) else batch.labels


def _mlp(widths, last_relu):
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_optimizer(model: DLRM, name: str, lr: float, table_lr: float):
    """The dense part's torch optimizer and the tables' row-wise one, each with its learning rate.

    The tables learn best slower than the dense part: an adaptive step moves an id seen once
    as far as a frequent one, and the long tail of rare ids then adds noise to every prediction.
    Under parameter servers the row optimizer runs on the ps tasks; in one process towerflow
    steps its torch twin (SparseAdam for SparseAdam, ...). FTRL exists on the ps only.
    """
    dense = model.dense_parameters()
    if name == "ftrl":
        return torch.optim.Adagrad(dense, lr=lr), towerflow.ps.FTRL(lr=table_lr)
    kind, rows = {"adagrad": (torch.optim.Adagrad, towerflow.ps.SparseAdagrad),
                  "adam": (torch.optim.Adam, towerflow.ps.SparseAdam),
                  "sgd": (torch.optim.SGD, towerflow.ps.SparseSGD)}[name]
    if kind is torch.optim.Adagrad:  # a first accumulator of 0 makes the first step lr * sign(g): it kills ReLUs
        return kind(dense, lr=lr, initial_accumulator_value=0.01), rows(lr=table_lr)
    return kind(dense, lr=lr), rows(lr=table_lr)


DEFAULT_LR = {"adagrad": (0.05, 0.01), "adam": (0.005, 0.001), "sgd": (1.0, 3.0), "ftrl": (0.05, 0.05)}  # (dense, tables)


def wire_minimum(cats: torch.Tensor, dim: int, dense_bytes: int, model=None, bags=()) -> int:
    """Bytes a step must move at least: the rows its batch touches, pulled and pushed, and the dense parameters."""
    feature_tables = model.feature_tables if model is not None else range(cats.shape[1])
    per_table = torch.tensor(list(feature_tables), dtype=torch.int64) << 40  # one id space: table in the high bits
    touched = [(cats + per_table).reshape(-1)]
    if model is not None:
        touched += [ids + (t << 40) for t, (ids, _) in zip(model.bag_tables, bags)]
    rows = torch.unique(torch.cat(touched)).numel()
    return 2 * (rows * dim * 4 + dense_bytes)


@torch.no_grad()
def evaluate(model: nn.Module, test_set, device, chunk: int = 8192) -> float:
    """AUC of the model's scores on a held-out set: Criteo's (dense, cats, labels), or `Features`."""
    model.eval()
    n = len(labels_of(test_set))
    scores = []
    for start in range(0, n, chunk):
        part = (tuple(t[start:start + chunk] for t in test_set) if isinstance(test_set, tuple)
                else test_set.slice(start, min(n, start + chunk)))
        dense, cats, bags = model_inputs(part)
        bags = tuple((ids.to(device), offsets.to(device)) for ids, offsets in bags)
        scores.append(model(dense.to(device), cats.to(device), bags).cpu())
    model.train()
    return auc(torch.cat(scores), labels_of(test_set))


def in_memory(batches_of, records, batch_size: int, worker: int, num_workers: int, seed: int):
    """This worker's share of `records` (every num_workers-th), reshuffled each epoch: training from memory."""
    mine = records.take(torch.arange(worker, len(records), num_workers))
    for epoch in itertools.count():
        order = torch.randperm(len(mine), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        shuffled = mine.take(order)
        for start in range(0, len(mine), batch_size):
            yield batches_of(shuffled.slice(start, min(len(mine), start + batch_size)))


def _widths(text: str) -> tuple:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected hidden widths as positive integers, e.g. 4096,2048")
    return widths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[towerflow.cluster_flags()],
                                allow_abbrev=False)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows (ids) per embedding table")
    p.add_argument("--tables", type=int, default=26, help="categorical features, one table each")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--bottom", type=_widths, default=(64,), metavar="W,W,...",
                   help="hidden widths of the bottom MLP (default 64)")
    p.add_argument("--top", type=_widths, default=(64,), metavar="W,W,...",
                   help="hidden widths of the top MLP (default 64; 4096,2048 makes a dense part of ~10M parameters)")
    p.add_argument("--batch-size", "--batch_size", type=int, default=1024, help="samples per step per worker")
    p.add_argument("--steps", type=int, default=300, help="global steps")
    p.add_argument("--optimizer", default="adagrad", choices=sorted(DEFAULT_LR))
    p.add_argument("--lr", type=float, default=None, help="learning rate of the dense part (default: per optimizer)")
    p.add_argument("--table-lr", "--table_lr", type=float, default=None,
                   help="learning rate of the embedding tables (default: per optimizer, (dense, tables): %s)" % DEFAULT_LR)
    p.add_argument("--seed", type=int, default=0, help="seeds the planted model, the data streams and the init")
    p.add_argument("--test-size", "--test_size", type=int, default=100_000, help="held-out samples for the AUC")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="train from the files of DIR/train (Criteo TSV, Parquet or Arrow) and test on DIR/test")
    p.add_argument("--format", default=None, choices=["criteo", "text", "parquet", "arrow"],
                   help="the files' format (default: from their extension; anything but .parquet/.arrow is text)")
    p.add_argument("--schema", default=None, metavar="FILE",
                   help="the files' columns (JSON or YAML: towerflow data inspect --write-schema makes one); the model "
                        "is built from it. Without --schema or --label the files are read in Criteo's layout")
    p.add_argument("--label", default=None, help="infer the schema from DIR/train's first file, with this label column "
                                                 "(every categorical --rows rows)")
    p.add_argument("--in-memory", "--in_memory", action="store_true",
                   help="read DIR/train whole into memory first and train from there (to compare with streaming)")
    p.add_argument("--shuffle-window", "--shuffle_window", type=int, default=16384,
                   help="records shuffled together while reading files (0: in file order)")
    p.add_argument("--logdir", default=os.environ.get("TOWERFLOW_LOGDIR"), help="checkpoints, metrics.jsonl, results")
    p.add_argument("--save-checkpoint-steps", "--save_checkpoint_steps", type=int, default=0,
                   help="the chief checkpoints every N global steps (with --logdir; 0: never — at 1M rows a "
                        "checkpoint of 26 tables and their optimizer state is gigabytes)")
    return p.parse_args(argv)  # the cluster flags (--ps_hosts ...) are accepted here and read by the Server


def main(argv=None):
    args = parse_args(argv)
    towerflow.set_seed(args.seed)
    torch.sparse.check_sparse_tensor_invariants.disable()  # opt out of per-step checks of the sparse gradients
    strategy = towerflow.strategy_from_env()
    if args.data and args.tables != 26 and not (args.schema or args.label):
        raise SystemExit(f"--tables {args.tables} with --data: Criteo-format files have 26 categorical columns (give "
                         "--schema FILE for other columns)")
    if (args.schema or args.label or args.in_memory) and not args.data:
        raise SystemExit("--schema, --label and --in-memory describe files: give --data DIR")
    data = None if args.data else synthetic_ctr(args.rows, args.tables, seed=args.seed, test_size=args.test_size)
    train_dir = os.path.join(args.data, "train") if args.data else None
    schema = (Schema.load(args.schema) if args.schema else
              Schema.infer(train_dir, label=args.label, rows=args.rows) if args.label else None)
    rows_per_table = [args.rows] * args.tables
    strategy.print(f"{strategy}; data {data or train_dir}")

    if schema is not None:
        model = DLRM.for_schema(schema, args.dim, table_device=strategy.table_device, bottom=args.bottom, top=args.top)
    else:
        model = DLRM(rows_per_table, 13, args.dim, table_device=strategy.table_device, bottom=args.bottom, top=args.top)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.dense_parameters())
    if getattr(strategy, "dense", "ps") == "allreduce":  # hybrid: the dense part never goes to the ps tasks
        dense_bytes = 0
    lr, table_lr = DEFAULT_LR[args.optimizer]
    lr, table_lr = lr if args.lr is None else args.lr, table_lr if args.table_lr is None else args.table_lr
    optimizer, rows = make_optimizer(model, args.optimizer, lr, table_lr)
    model, optimizer = strategy.setup(model, optimizer, sparse_optimizer=rows)
    if args.data:
        files = strategy.distribute_files(train_dir, args.format, args.batch_size, None if schema else rows_per_table,
                                          shuffle_window=args.shuffle_window, seed=args.seed, schema=schema)
        schema = files.schema if schema is not None else None  # standardized columns: fitted on the training files
        if args.in_memory:
            whole = read_all(train_dir, args.format, None if schema else rows_per_table, schema=schema)
            records = whole if schema is not None else _as_features(files, whole)
            stream = in_memory(lambda b: b if schema is not None else b.as_tuple(), records, args.batch_size,
                               strategy.replica_id, strategy.num_replicas_in_sync, args.seed)
        else:
            stream = iter(files)
    else:
        stream = data.batches(args.batch_size, worker=strategy.replica_id, num_workers=strategy.num_replicas_in_sync,
                              seed=args.seed)

    def train_step(dense, cats, bags, labels):
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, cats, bags), labels)
        strategy.backward(loss)
        optimizer.step()
        return loss.item()

    start, steps, minimum, losses = time.perf_counter(), 0, 0, []
    with towerflow.MonitoredTrainingSession(  # global steps: all workers' updates count (one process: its own)
        model, optimizer, strategy=strategy, logdir=args.logdir, hooks=[towerflow.StopAtStepHook(last_step=args.steps)],
        save_checkpoint_steps=args.save_checkpoint_steps or None, save_checkpoint_secs=None, log_step_count_steps=0,
        progress=False,
    ) as session:
        while not session.should_stop():
            batch = next(stream)
            dense, cats, bags = model_inputs(batch)
            minimum += wire_minimum(cats, args.dim, dense_bytes, strategy.unwrap(model), bags)
            device = strategy.device
            bags = tuple((ids.to(device), offsets.to(device)) for ids, offsets in bags)
            losses.append(session.run(train_step, dense.to(device), cats.to(device), bags, labels_of(batch).to(device)))
            steps += 1
            if strategy.is_chief and steps % 100 == 0:
                print(f"step {strategy.global_step}/{args.steps}  loss {sum(losses[-100:]) / 100:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"worker {strategy.replica_id}: {steps} steps in {elapsed:.1f}s, "
          f"{steps * args.batch_size / elapsed:.0f} samples/s", flush=True)
    wire = _wire_line(strategy, steps, minimum // max(steps, 1))
    if not strategy.is_chief:
        strategy.shutdown()
        return None
    if strategy.shared_variables:
        strategy.wait_for_workers()  # evaluate the final variables
    test_set = (read_all(os.path.join(args.data, "test"), args.format, None if schema else rows_per_table, schema=schema)
                if args.data else data.test_set())
    test_auc = evaluate(strategy.unwrap(model), test_set, strategy.device)  # the chief alone: no DDP wrapper
    best = data.best_auc if data is not None else None
    if args.logdir:
        save_metrics(args.logdir, {"test_auc": test_auc, "best_auc": best, "steps": steps,
                                   "global_step": strategy.global_step, "wire": wire})
    held_out = f"best possible: {best:.4f}" if best is not None else f"{len(labels_of(test_set))} held-out records"
    print(f"test auc: {test_auc:.4f} ({held_out})", flush=True)
    print(wire, flush=True)
    strategy.shutdown()
    return test_auc, best


def _as_features(stream, whole):
    """Criteo's (dense, cats, labels) held whole, as `Features` to shuffle and cut like any batch."""
    from towerflow.data import Features

    return Features.from_tuple(stream.names, *whole)


def _wire_line(strategy, steps: int, minimum: int) -> str:
    """What this worker moved per step against the minimum; nothing moves in one process."""
    metrics = strategy.metrics() if hasattr(strategy, "metrics") else {}
    if "bytes_pushed" not in metrics or "bytes_pulled" not in metrics:
        return f"wire: 0 bytes/step (one process: nothing travels; minimum {minimum})"
    moved = sum(metrics["bytes_pushed"].values()) + sum(metrics["bytes_pulled"].values())
    return f"wire: {moved // max(steps, 1)} bytes/step (minimum {minimum})"


if __name__ == "__main__":
    main()
