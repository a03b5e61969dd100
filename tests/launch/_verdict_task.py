"""A tiny ps job one of whose tasks raises: python _verdict_task.py JOB:INDEX STEP [STEPS]

Under `towerflow launch --chief --ps 1 --workers 1`. The chief and the worker fit a line on
the ps (a few hundred parameters' worth of work, no data files); the task named JOB:INDEX
raises `RuntimeError("injected failure in JOB:INDEX at step STEP")` once the global step
reaches STEP. The ps has no training loop of its own: it watches the global step the chief
publishes and raises from its main thread. Every other task runs until STEPS (default 10000,
far more than a test lets it reach) so that only the injected failure ends the run.
"""

import os
import sys
import time

import torch
from torch import nn

import towerflow

who, fail_at = sys.argv[1], int(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10000
server = towerflow.Server()
me = f"{server.job_name}:{server.task_index}"


def fail(step: int) -> None:
    raise RuntimeError(f"injected failure in {me} at step {step}")


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
while strategy.global_step < steps:
    if who == me and strategy.global_step >= fail_at:
        fail(strategy.global_step)
    x = torch.randn(8, 4, generator=g)
    optimizer.zero_grad()
    ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
    optimizer.step()
    if strategy.is_chief:
        server.publish("verdict/step", str(strategy.global_step))
    time.sleep(0.01)
strategy.shutdown()
server.join()
