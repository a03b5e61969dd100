"""A tiny job one of whose tasks raises: python _verdict_task.py JOB:INDEX STEP DIR

Under `towerflow launch --chief --ps 1 --workers 1` (or without ps tasks: all-reduce, no
Server). The replicas fit a 5-parameter linear model (no data files); the task named
JOB:INDEX raises `RuntimeError("injected failure in JOB:INDEX at step STEP")` once the global
step reaches STEP. The ps has no training loop of its own: it watches the global step the chief
publishes and raises from its main thread. Nothing else ends the run: the others train on.
Each task writes its pid to DIR/<job>:<index>.pid first, so that a test can check none is left.
"""

import os
import sys
import time

import torch
from torch import nn

import towerflow

who, fail_at, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
me = f"{os.environ['TOWERFLOW_JOB_NAME']}:{os.environ['TOWERFLOW_TASK_INDEX']}"
with open(os.path.join(folder, f"{me}.pid"), "w") as f:
    f.write(str(os.getpid()))


def fail(step: int) -> None:
    raise RuntimeError(f"injected failure in {me} at step {step}")


if '"ps"' not in os.environ["TF_CONFIG"]:  # all-reduce replicas: a gloo process group, no Server
    strategy = towerflow.strategy_from_env()
    line = nn.Linear(4, 1)
    model, optimizer = strategy.setup(line, torch.optim.SGD(line.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(strategy.replica_id)
    for step in range(10**9):
        if who == me and step >= fail_at:
            fail(step)
        x = torch.randn(8, 4, generator=g).to(strategy.device)
        optimizer.zero_grad()
        ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        optimizer.step()
        time.sleep(0.01)

server = towerflow.Server()

if server.job_name == "ps":
    while who == me:  # serve (the RPC threads do) until the chief's published step reaches fail_at
        step = int(server.lookup("verdict/step") or 0)
        if step >= fail_at:
            fail(step)
        time.sleep(0.02)
    server.join()
    sys.exit(0)

strategy = towerflow.ParameterServerStrategy(server=server)
model = nn.Linear(4, 1)
model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
g = torch.Generator().manual_seed(strategy.replica_id)
while True:
    if who == me and strategy.global_step >= fail_at:
        fail(strategy.global_step)
    x = torch.randn(8, 4, generator=g).to(strategy.device)
    optimizer.zero_grad()
    ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
    optimizer.step()
    if strategy.is_chief:
        server.publish("verdict/step", str(strategy.global_step))
    time.sleep(0.01)
