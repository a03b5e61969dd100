"""MNIST with parameter servers, in any of the three modes.

    towerflow launch --ps 1 --workers 2 examples/mnist_ps.py --data ../shared/data/mnist-t10k --mode async
    towerflow launch --ps 1 --workers 2 examples/mnist_ps.py --data ../shared/data/mnist-t10k --mode sync
    towerflow launch --ps 1 --workers 3 examples/mnist_ps.py --data ../shared/data/mnist-t10k --mode sync --replicas-to-aggregate 2
    towerflow launch --ps 1 --workers 2 examples/mnist_ps.py --data ../shared/data/mnist-t10k --mode ssp --staleness 2
    towerflow launch --ps 1 --workers 2 --local-steps 4 examples/mnist_ps.py --data ../shared/data/mnist-t10k --steps 150

The model of examples/mnist_sync.py (MNIST-t10k: first 8,000 images train, last 2,000 test;
scikit-learn's 8x8 digits without --data). The variables and Adam live on the ps; every
worker reads its own shard of the data. --steps counts global steps, as TF's StopAtStepHook
does: an update in sync mode, a push otherwise (with --local-steps K a push follows K local
steps: divide --steps by K for the same number of samples). The chief evaluates the final variables.

Training runs under a MonitoredTrainingSession: with --logdir the chief checkpoints the ps
state every --save-checkpoint-steps, and with `towerflow launch --max-restarts N` the job
survives a killed worker, ps or chief (docs/fault-tolerance.md):

    towerflow launch --ps 1 --workers 2 --max-restarts 3 --logdir runs/mnist_ps examples/mnist_ps.py --data ../shared/data/mnist-t10k

On several machines, one cluster file and one launch per host (docs/cluster.md, "Several
machines"); there a worker host that lost every process rejoins when its launch is started
again (every host with --max-restarts N), and losing the coordinator's host (worker 0) ends the job
unless the rendezvous is kept in etcd (--store etcd://..., docs/cluster.md "The store"):

    towerflow launch --cluster cluster.json --job_name worker --task_index 1 --max-restarts 1 examples/mnist_ps.py --data DIR
    towerflow launch --cluster cluster.json --job_name worker --task_index 0 --max-restarts 3 \
        --store etcd://10.0.0.1:2379,10.0.0.3:2379,10.0.0.4:2379 examples/mnist_ps.py --data DIR
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import towerflow
from towerflow.data import load_mnist_or_digits
from towerflow.training import cosine_decay, save_metrics


def build_model(side: int) -> nn.Module:
    """Two conv/pool blocks and a classifier (as examples/mnist_sync.py)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (side // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[towerflow.cluster_flags()],
                                allow_abbrev=False)
    p.add_argument("--data", default=os.environ.get("TOWERFLOW_DATA"), help="folder with MNIST t10k IDX files")
    p.add_argument("--steps", type=int, default=600, help="global steps")
    p.add_argument("--batch-size", "--batch_size", type=int, default=64, help="global batch size, split across workers")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--mode", default=os.environ.get("TOWERFLOW_PS_MODE", "async"), choices=["async", "sync", "ssp"])
    p.add_argument("--replicas-to-aggregate", "--replicas_to_aggregate", type=int, default=None)
    p.add_argument("--staleness", type=int, default=None, help="ssp bound k (default 0)")
    p.add_argument("--local-steps", "--local_steps", type=int, default=None,
                   help="geo: K optimizer steps on the worker per push of its parameter delta (default: "
                        "towerflow launch --local-steps, else 1)")
    p.add_argument("--prefetch", action="store_true", help="pull the next values while computing (async, ssp)")
    p.add_argument("--staleness-aware-lr", "--staleness_aware_lr", action="store_true",
                   help="divide the learning rate by each push's staleness (async, ssp)")
    p.add_argument("--logdir", default=os.environ.get("TOWERFLOW_LOGDIR"), help="checkpoints and metrics.jsonl")
    p.add_argument("--save-checkpoint-steps", "--save_checkpoint_steps", type=int, default=100,
                   help="the chief checkpoints the ps state every N global steps (with --logdir)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)  # the cluster flags (--ps_hosts ...) are accepted here and read by the Server


def main(argv=None):
    args = parse_args(argv)
    towerflow.set_seed(args.seed)
    strategy = towerflow.ParameterServerStrategy(  # the chief and workers; `towerflow launch` has the ps tasks serve
        mode=args.mode, replicas_to_aggregate=args.replicas_to_aggregate, staleness=args.staleness, prefetch=args.prefetch,
        staleness_aware_lr=args.staleness_aware_lr, local_steps=args.local_steps,
    )
    split = load_mnist_or_digits(args.data)
    strategy.print(f"{strategy}; data {split.name}: {len(split.train)} train / {len(split.test)} test")

    model = build_model(split.train.tensors[0].shape[-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = strategy.setup(model, optimizer, lr_schedule=cosine_decay(args.lr, args.steps, alpha=0.05))
    train = strategy.distribute_loader(split.train, global_batch_size=args.batch_size, seed=args.seed)

    start = time.perf_counter()
    losses = []
    with towerflow.MonitoredTrainingSession(
        model, optimizer, strategy=strategy, logdir=args.logdir, hooks=[towerflow.StopAtStepHook(last_step=args.steps)],
        save_checkpoint_steps=args.save_checkpoint_steps, log_step_count_steps=0, progress=False,
    ) as session:
        for batch in train.forever():
            if session.should_stop():
                break
            loss = session.run(towerflow.train_step, strategy, model, optimizer, batch, F.cross_entropy)
            losses.append(float(loss))
            if strategy.is_chief and len(losses) % 100 == 0:
                print(f"step {strategy.global_step}/{args.steps}  loss {sum(losses[-100:]) / 100:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    m = strategy.metrics()
    print(f"worker {strategy.replica_id}: {m['steps']} steps at {m['steps_per_s']:.1f} steps/s, "
          f"{m['pushes_dropped']} pushes dropped, staleness {m['staleness_histogram']}", flush=True)
    if not strategy.is_chief:
        strategy.shutdown()
        return None
    strategy.wait_for_workers()  # then evaluate the final variables
    ps = strategy.ps_metrics()
    test = ((x.to(strategy.device), y.to(strategy.device)) for x, y in DataLoader(split.test, batch_size=500))
    metrics = towerflow.evaluate(strategy, model, test)
    print(f"{strategy.global_step} global steps in {elapsed:.1f}s; ps: "
          + "; ".join(f"{t}: {p['applied_updates']} updates, {p['dropped_stale']} stale dropped" for t, p in ps.items()),
          flush=True)
    if args.logdir:
        save_metrics(args.logdir, {**metrics, "global_step": strategy.global_step, "mode": args.mode, "ps": ps,
                                   "worker": m})
    print(f"test accuracy: {metrics['accuracy']:.4f}", flush=True)
    strategy.shutdown()
    return metrics["accuracy"]


if __name__ == "__main__":
    main()
