"""One worker of benchmarks/ps_replicas.py's small-MLP job: python _replicas_task.py STEPS [HIDDEN]

ps_step.py's setup (an MLP 64-256-256-10 on the 8x8 digits, batch 32, SGD lr 0.05) under whatever
`towerflow launch` gave the task (`--ps-replicas`). Prints `steps/s R` over its steps after the first
100 (connecting, the first link and the first optimizer out of the measure).
"""

import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow.data import load_mnist_or_digits

steps = int(sys.argv[1])
hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 256  # the hidden layers' width (256: 84,490 parameters)
WARMUP = 100
strategy = towerflow.strategy_from_env()
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                      nn.Linear(hidden, 10))
model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
x, y = load_mnist_or_digits(None).train.tensors
g = torch.Generator().manual_seed(strategy.replica_id)
start = None
for i in range(steps + WARMUP):
    if i == WARMUP:
        start = time.perf_counter()
    idx = torch.randint(0, len(y), (32,), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    optimizer.step()
elapsed = time.perf_counter() - start
print(f"worker {strategy.replica_id}: steps/s {steps / elapsed:.1f}", flush=True)
strategy.shutdown()
