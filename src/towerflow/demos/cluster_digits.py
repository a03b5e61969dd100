"""The main demo's training script: every task of the embedded cluster runs it.

`towerflow demo` launches it as 1 ps + 2 workers (async parameter-server training) on
scikit-learn's digits, which ship with the package: no download. The ps task serves the
variables; the workers train under a MonitoredTrainingSession; the chief prints the device
mapping and a few placement-log lines, evaluates and checkpoints; `towerflow demo` draws the
report once every task has ended (cli/demo.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow import taskenv as _taskenv
from towerflow.data import load_mnist_or_digits
from towerflow.session import LoggingHook, MonitoredTrainingSession
from towerflow.training import save_metrics


def build_model() -> nn.Module:
    """The MNIST-style CNN of examples/mnist_sync.py, sized for 8x8 digits."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def _show_placement(model: nn.Module, sample: torch.Tensor) -> None:
    """A few lines of the placement log: one forward pass of the model, logged per op."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("towerflow.placement")
    logger.addHandler(handler)
    towerflow.configure(log_device_placement=True)
    with torch.no_grad():
        model(sample)
    towerflow.configure(log_device_placement=False)
    logger.removeHandler(handler)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data", default=None, help="folder with MNIST-t10k IDX files (default: scikit-learn digits)")
    parser.add_argument("--steps", type=int, default=1500, help="global steps (both workers' pushes count)")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32, help="per worker")
    parser.add_argument("--logdir", default=_taskenv.from_environment().tuning.logdir or "runs/demo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    towerflow.set_seed(args.seed)
    strategy = towerflow.strategy_from_env()  # the workers; the launcher has the ps task serve the variables
    data = load_mnist_or_digits(args.data)
    model = build_model() if data.train.tensors[0].shape[-1] == 8 else None
    if model is None:
        raise SystemExit("the demo model is for 8x8 digits; run examples/mnist_ps.py for MNIST")
    if strategy.is_chief:
        _show_placement(model, data.train.tensors[0][:2])  # the log starts with the device mapping
    model, optimizer = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=2e-3))
    batches = strategy.distribute_loader(data.train, batch_size=args.batch_size, seed=args.seed).forever()

    def step(x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    started = time.perf_counter()
    # Each worker runs its share of the steps. (A global-step stop would let a worker that started
    # late find the budget already spent by the other one and train nothing: async waits for no one.)
    share = max(1, args.steps // strategy.num_replicas_in_sync)
    hooks = [LoggingHook(every_n_steps=max(1, share // 6), all_tasks=True)]
    with MonitoredTrainingSession(model, optimizer, strategy=strategy, logdir=args.logdir, hooks=hooks,
                                  log_step_count_steps=0, save_checkpoint_steps=max(1, args.steps // 2),
                                  progress=False) as session:
        while session.local_steps < share and not session.should_stop():
            x, y = next(batches)
            session.run(step, x, y)
    test = strategy.distribute_loader(data.test, global_batch_size=len(data.test), shuffle=False)
    accuracy = towerflow.evaluate(strategy, model, test)["accuracy"]
    if strategy.is_chief:
        print(f"trained to global step {strategy.global_step} in {time.perf_counter() - started:.1f} s", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)
        save_metrics(args.logdir, {"accuracy": accuracy, "global_step": strategy.global_step, "mode": "async"})
    strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
