"""Synchronous data-parallel MNIST: the same script on one device or on N workers.

    python examples/mnist_sync.py --data ../shared/data/mnist-t10k
    towerflow launch --workers 2 examples/mnist_sync.py --data ../shared/data/mnist-t10k

Trains a small CNN on MNIST-t10k (first 8,000 images train, last 2,000 test); without
--data it uses scikit-learn's 8x8 digits. --batch-size is the global batch, split across
replicas, so the result does not depend on how many replicas run it.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow.data import load_mnist_or_digits
from towerflow.training import cosine_decay, save_metrics


def build_model(side: int) -> nn.Module:
    """Two conv/pool blocks and a classifier; works for 28x28 MNIST and 8x8 digits."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (side // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[towerflow.cluster_flags()],
                                allow_abbrev=False)
    p.add_argument("--data", default=os.environ.get("TOWERFLOW_DATA"), help="folder with MNIST t10k IDX files")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", "--batch_size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--logdir", default=os.environ.get("TOWERFLOW_LOGDIR"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, metavar="FILE", help="write the trained model's state_dict here (chief)")
    p.add_argument("--variables-on", "--variables_on", default="device", choices=["device", "cpu"])
    p.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)  # tests: a replica raises
    return p.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    towerflow.set_seed(args.seed)
    strategy = towerflow.strategy_from_env(variables_on=args.variables_on)
    split = load_mnist_or_digits(args.data)
    strategy.print(f"{strategy}; data {split.name}: {len(split.train)} train / {len(split.test)} test")

    model = build_model(split.train.tensors[0].shape[-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = strategy.setup(model, optimizer, lr_schedule=cosine_decay(args.lr, args.steps, alpha=0.05))
    train = strategy.distribute_loader(split.train, global_batch_size=args.batch_size, seed=args.seed)
    test = strategy.distribute_loader(split.test, global_batch_size=500, shuffle=False)

    start = time.perf_counter()
    with towerflow.Progress(strategy, args.steps, log_every=100) as progress:
        for step, batch in zip(range(args.steps), train.forever()):
            if args.fail_at_step == step and strategy.replica_id == strategy.num_replicas_in_sync - 1:
                raise RuntimeError(f"injected failure at step {step}")
            loss = towerflow.train_step(strategy, model, optimizer, batch, F.cross_entropy)
            progress.update(loss)
    metrics = towerflow.evaluate(strategy, model, test)
    strategy.print(
        f"{args.steps} steps in {time.perf_counter() - start:.1f}s, "
        f"{progress.samples_per_sec:.0f} samples/s ({progress.samples_per_sec_per_replica:.0f}/replica)"
    )
    if args.logdir and strategy.is_chief:
        save_metrics(args.logdir, {**metrics, "global_step": strategy.global_step, "samples_per_sec": progress.samples_per_sec})
    if args.save and strategy.is_chief:  # written whole or not at all
        torch.save({k: v.detach().cpu() for k, v in strategy.unwrap(model).state_dict().items()}, args.save + ".tmp")
        os.replace(args.save + ".tmp", args.save)
    strategy.print(f"test accuracy: {metrics['accuracy']:.4f}")
    strategy.shutdown()
    return metrics["accuracy"]


if __name__ == "__main__":
    main()
