"""A replica that trains a few DDP steps, shuts its strategy down and, still holding the model, prints how many of
gloo's threads its process runs: python _shutdown_script.py (under run_replicas)."""

import os

import torch
import torch.nn.functional as F

import towerflow


def gloo_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def main() -> None:
    strategy = towerflow.strategy_from_env()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for _ in range(3):
        towerflow.train_step(strategy, model, optimizer, (x, y), F.cross_entropy)
    print(f"during training: {gloo_threads()} gloo threads", flush=True)
    strategy.shutdown()
    print(f"after shutdown: {gloo_threads()} gloo threads", flush=True)  # the model still held here
    del model, optimizer


main()
