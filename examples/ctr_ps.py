"""A DLRM-style click model on Criteo-shaped synthetic data, with sparse embedding tables.

    python examples/ctr_ps.py --rows 100000 --steps 300          # one process
    python examples/ctr_ps.py --rows 1000000 --optimizer adam    # SparseAdam for the tables, Adam for the rest
    towerflow launch --ps 2 --workers 2 examples/ctr_ps.py --rows 1000000                     # async
    towerflow launch --ps 2 --workers 2 --mode sync --replicas-to-aggregate 1 examples/ctr_ps.py --rows 1000000
    towerflow launch --ps 2 --workers 2 --mode ssp --staleness 2 examples/ctr_ps.py --rows 1000000
    towerflow launch --ps 1 --workers 2 examples/ctr_ps.py --data DIR --rows 100000   # from files

With `--data DIR` the model trains from click-log files instead: DIR/train holds Criteo's TSV
(label, 13 integers, 26 hex categoricals), Parquet or Arrow IPC files, each worker reading its share
of them (`strategy.distribute_files`), and the AUC is measured on every record of DIR/test (Criteo's
convention: the last day held out). `python -m towerflow.data.write_ctr DIR --format parquet` writes
the synthetic data below as such files, its test set included.

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
job launched with `--max-restarts 1` survives a killed ps (docs/parameter-server.md).

Measured in one process (2-core AMD EPYC, 1 thread), adagrad: --rows 100000 --steps 300 reaches
0.8151 against a best of 0.8228; --rows 1000000 gets within 0.01 of its best in about 200
steps (0.8037 at 100, 0.8140 at 200, 0.8165 at 300; best 0.8223).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow.data import auc, read_all, synthetic_ctr
from towerflow.training import save_metrics


class DLRM(nn.Module):
    """Embedding bags per table, a bottom MLP over the dense features, pairwise dot interactions, a top MLP.

    `bottom` and `top` are the hidden widths; the bottom MLP ends at `dim` (so its output can
    be dotted with the embeddings) and the top MLP at one logit. `table_device="meta"` builds
    the tables without memory (for a worker whose tables live on the ps tasks).
    """

    def __init__(self, rows_per_table, num_dense=13, dim=16, bottom=(64,), top=(64,), table_device=None, sparse=True):
        super().__init__()
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse, device=table_device) for rows in rows_per_table
        )
        for table in self.tables:  # DLRM's init: small rows, so ids never seen in training add ~nothing
            bound = table.num_embeddings ** -0.5
            nn.init.uniform_(table.weight, -bound, bound)  # (a no-op on the meta device)
            table.init_std = bound / 3 ** 0.5  # the same spread where the ps draws the rows
        self.bottom = _mlp([num_dense, *bottom, dim], last_relu=True)
        vectors = len(self.tables) + 1
        i, j = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", i * vectors + j, persistent=False)  # the upper triangle, as flat indices
        self.top = _mlp([dim + len(self.pairs), *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        bags = [table(cats[:, i : i + 1]) for i, table in enumerate(self.tables)]  # a bag of one id per sample
        z = torch.stack([x, *bags], 1)  # [B, tables + 1, dim]
        dots = torch.bmm(z, z.transpose(1, 2)).flatten(1).index_select(1, self.pairs)  # each pair once
        return self.top(torch.cat([x, dots], 1)).squeeze(1)

    def dense_parameters(self):
        """Everything but the tables: the parameters every step reads and updates in full."""
        tables = {id(p) for p in self.tables.parameters()}
        return [p for p in self.parameters() if id(p) not in tables]


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


def wire_minimum(cats: torch.Tensor, dim: int, dense_bytes: int) -> int:
    """Bytes a step must move at least: the rows its batch touches, pulled and pushed, and the dense parameters."""
    per_table = torch.arange(cats.shape[1], dtype=torch.int64) << 32  # one id space: table in the high bits
    rows = torch.unique(cats + per_table).numel()
    return 2 * (rows * dim * 4 + dense_bytes)


@torch.no_grad()
def evaluate(model: nn.Module, test_set, device, chunk: int = 8192) -> float:
    """AUC of the model's scores on a held-out (dense, cats, labels)."""
    model.eval()
    dense, cats, labels = test_set
    scores = torch.cat([model(d.to(device), c.to(device)).cpu() for d, c in zip(dense.split(chunk), cats.split(chunk))])
    model.train()
    return auc(scores, labels)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[towerflow.cluster_flags()],
                                allow_abbrev=False)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows (ids) per embedding table")
    p.add_argument("--tables", type=int, default=26, help="categorical features, one table each")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
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
    p.add_argument("--format", default=None, choices=["criteo", "parquet", "arrow"],
                   help="the files' format (default: from their extension; anything but .parquet/.arrow is Criteo TSV)")
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
    if args.data and args.tables != 26:
        raise SystemExit(f"--tables {args.tables} with --data: Criteo-format files have 26 categorical columns")
    data = None if args.data else synthetic_ctr(args.rows, args.tables, seed=args.seed, test_size=args.test_size)
    rows_per_table = [args.rows] * args.tables
    strategy.print(f"{strategy}; data {data or os.path.join(args.data, 'train')}")

    model = DLRM(rows_per_table, 13, args.dim, table_device=strategy.table_device)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.dense_parameters())
    lr, table_lr = DEFAULT_LR[args.optimizer]
    lr, table_lr = lr if args.lr is None else args.lr, table_lr if args.table_lr is None else args.table_lr
    optimizer, rows = make_optimizer(model, args.optimizer, lr, table_lr)
    model, optimizer = strategy.setup(model, optimizer, sparse_optimizer=rows)
    if args.data:
        files = strategy.distribute_files(os.path.join(args.data, "train"), args.format, args.batch_size, rows_per_table,
                                          shuffle_window=args.shuffle_window, seed=args.seed)
        stream = iter(files)
    else:
        stream = data.batches(args.batch_size, worker=strategy.replica_id, num_workers=strategy.num_replicas_in_sync,
                              seed=args.seed)

    def train_step(dense, cats, labels):
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, cats), labels)
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
            dense, cats, labels = (t.to(strategy.device) for t in next(stream))
            minimum += wire_minimum(cats.cpu(), args.dim, dense_bytes)
            losses.append(session.run(train_step, dense, cats, labels))
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
    test_set = read_all(os.path.join(args.data, "test"), args.format, rows_per_table) if args.data else data.test_set()
    test_auc = evaluate(model, test_set, strategy.device)
    best = data.best_auc if data is not None else None
    if args.logdir:
        save_metrics(args.logdir, {"test_auc": test_auc, "best_auc": best, "steps": steps,
                                   "global_step": strategy.global_step, "wire": wire})
    held_out = f"best possible: {best:.4f}" if best is not None else f"{len(test_set[2])} held-out records"
    print(f"test auc: {test_auc:.4f} ({held_out})", flush=True)
    print(wire, flush=True)
    strategy.shutdown()
    return test_auc, best


def _wire_line(strategy, steps: int, minimum: int) -> str:
    """What this worker moved per step against the minimum; nothing moves in one process."""
    metrics = strategy.metrics() if hasattr(strategy, "metrics") else {}
    if "bytes_pushed" not in metrics or "bytes_pulled" not in metrics:
        return f"wire: 0 bytes/step (one process: nothing travels; minimum {minimum})"
    moved = sum(metrics["bytes_pushed"].values()) + sum(metrics["bytes_pulled"].values())
    return f"wire: {moved // max(steps, 1)} bytes/step (minimum {minimum})"


if __name__ == "__main__":
    main()
