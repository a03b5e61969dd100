"""Seed 001's multi-GPU CIFAR-10 training ("towers"), written the towerflow way.

    python examples/cifar10_towers.py                        # synthetic CIFAR-shaped data, one device
    python examples/cifar10_towers.py --data ~/cifar-10-batches-py
    towerflow launch --workers 2 examples/cifar10_towers.py

TF 1.x built one tower per GPU, averaged the towers' gradients on /cpu:0 and applied them
with an exponentially decaying learning rate keyed on global_step. Here each tower is a
replica process; the averaging is DDP's all-reduce (or, with --variables-on cpu, the seed's
own layout: gradients averaged on the host CPU, variables updated there).
"""

import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import towerflow
from towerflow.training import exponential_decay, save_metrics

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def cifar10_inference(width: int = 32) -> nn.Module:
    """The seed's `cifar10.inference`: two conv/pool/norm blocks, then 384 and 192 units.

    BatchNorm stands in for the seed's local response normalisation (same place, trains faster).
    """
    return nn.Sequential(
        nn.Conv2d(3, width, 5, padding=2), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(width, 2 * width, 5, padding=2), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Flatten(), nn.Linear(2 * width * 8 * 8, 384), nn.ReLU(), nn.Linear(384, 192), nn.ReLU(), nn.Linear(192, 10),
    )


def _load_batch(path: str):
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    x = torch.from_numpy(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)).float().div_(255)
    return (x - MEAN) / STD, torch.tensor(d[b"labels"], dtype=torch.long)


def load_cifar10(path: str):
    """The python-pickle CIFAR-10 (`cifar-10-batches-py`): data_batch_1..5 train, test_batch test."""
    names = [f"data_batch_{i}" for i in range(1, 6)]
    missing = [n for n in names + ["test_batch"] if not os.path.exists(os.path.join(path, n))]
    if missing:
        raise towerflow.DataError(
            f"--data {path!r} lacks {missing}: expected the extracted cifar-10-batches-py folder "
            "(or leave --data out for synthetic data)"
        )
    parts = [_load_batch(os.path.join(path, n)) for n in names]
    train = TensorDataset(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return train, TensorDataset(*_load_batch(os.path.join(path, "test_batch")))


def synthetic_cifar10(n_train: int = 6000, n_test: int = 1000, seed: int = 0):
    """CIFAR-shaped data with a learnable signal: each class is a fixed random image plus noise."""
    g = torch.Generator().manual_seed(seed + 12345)
    templates = torch.randn(10, 3, 32, 32, generator=g)

    def make(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return TensorDataset(0.4 * templates[y] + torch.randn(n, 3, 32, 32, generator=g), y)

    return make(n_train), make(n_test)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[towerflow.cluster_flags()],
                                allow_abbrev=False)
    p.add_argument("--data", default=None, help="cifar-10-batches-py folder; synthetic data when left out")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", "--batch_size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--logdir", default=os.environ.get("TOWERFLOW_LOGDIR"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variables-on", "--variables_on", default="device", choices=["device", "cpu"])
    p.add_argument("--mixed-precision", "--mixed_precision", default=None, choices=["bf16", "fp16"])
    p.add_argument("--width", type=int, default=32, help="channels of the first conv layer")
    return p.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    towerflow.set_seed(args.seed)
    strategy = towerflow.strategy_from_env(variables_on=args.variables_on, mixed_precision=args.mixed_precision)
    train_set, test_set = load_cifar10(args.data) if args.data else synthetic_cifar10(seed=args.seed)
    strategy.print(f"{strategy}; {'CIFAR-10' if args.data else 'synthetic CIFAR-10'}: {len(train_set)} train")

    model = cifar10_inference(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=4e-3)
    decay_steps = max(1, args.steps // 3)  # the seed: staircase decay by 10x every few epochs
    model, optimizer = strategy.setup(
        model, optimizer, lr_schedule=exponential_decay(args.lr, decay_steps, 0.1, staircase=True), clip_grad_norm=5.0
    )
    train = strategy.distribute_loader(train_set, global_batch_size=args.batch_size, seed=args.seed)
    test = strategy.distribute_loader(test_set, global_batch_size=500, shuffle=False)

    start = time.perf_counter()
    with towerflow.Progress(strategy, args.steps, log_every=25) as progress:
        for _, batch in zip(range(args.steps), train.forever()):
            progress.update(towerflow.train_step(strategy, model, optimizer, batch, F.cross_entropy))
    metrics = towerflow.evaluate(strategy, model, test, F.cross_entropy)
    elapsed = time.perf_counter() - start
    strategy.print(
        f"{args.steps} steps in {elapsed:.1f}s, {progress.samples_per_sec:.0f} samples/s "
        f"({progress.samples_per_sec_per_replica:.0f}/replica, {strategy.num_replicas_in_sync} replicas)"
    )
    if args.logdir and strategy.is_chief:
        save_metrics(args.logdir, {**metrics, "global_step": strategy.global_step, "samples_per_sec": progress.samples_per_sec})
    strategy.print(f"test accuracy: {metrics['accuracy']:.4f}")
    strategy.shutdown()
    return metrics["accuracy"]


if __name__ == "__main__":
    main()
