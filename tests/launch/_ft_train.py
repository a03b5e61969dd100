"""Linear regression on a ps that a test kills a worker of mid-training: python _ft_train.py DIR STEPS

The ps mode comes from the launcher (--mode, default async). Every worker trains until the
global step (on the ps) reaches STEPS, sleeping a little per step so that a kill lands
mid-training; after its first 20 steps each incarnation writes "PID GLOBAL_STEP" to
DIR/<job>:<index>.<restart>.pid. So that the restarted worker really continues however long
its restart takes, the chief also goes on until the ps has seen worker 1 rejoin and 200 more
steps have passed, and a restarted worker trains at least 50 steps. The chief prints the fit.
"""

import os
import sys
import time

import torch
from torch import nn

import towerflow

folder, steps = sys.argv[1], int(sys.argv[2])
server = towerflow.Server()
if server.job_name == "ps":
    server.join()
    sys.exit(0)


class Line(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(-1.0))
        self.b = nn.Parameter(torch.tensor(-2.0))

    def forward(self, x):
        return x * self.w + self.b


strategy = towerflow.ParameterServerStrategy(server=server)
x = torch.linspace(-1, 1, 101)
y = 2 * x + torch.randn(x.shape, generator=torch.Generator().manual_seed(4)) * 0.4 + 0.2
model = Line()
model, optimizer = strategy.setup(model, torch.optim.Adagrad(model.parameters(), lr=0.5))
order = torch.Generator().manual_seed(10 + strategy.replica_id + 100 * server.incarnation)
local = 0
rejoined_at = None  # chief: the global step when it saw worker 1 rejoin


def chief_waits() -> bool:
    global rejoined_at
    if not strategy.is_chief:
        return False
    if rejoined_at is None and local % 20 == 0:
        if strategy.ps_metrics()["/job:ps/task:0"]["rejoins_by_worker"].get(1):
            rejoined_at = strategy.global_step
    return rejoined_at is None or strategy.global_step < rejoined_at + 200


while strategy.global_step < steps or chief_waits() or (server.incarnation > 0 and local < 50):
    idx = torch.randint(0, len(x), (10,), generator=order)
    optimizer.zero_grad()
    ((model(x[idx]) - y[idx]) ** 2).mean().backward()
    optimizer.step()
    local += 1
    if local == 20:
        name = f"{server.job_name}:{server.task_index}.{server.incarnation}"
        with open(os.path.join(folder, name + ".pid.tmp"), "w") as f:
            f.write(f"{os.getpid()} {strategy.global_step}")
        os.replace(os.path.join(folder, name + ".pid.tmp"), os.path.join(folder, name + ".pid"))
    time.sleep(0.005)
print(f"worker {strategy.replica_id} (restart {server.incarnation}): {local} steps, global step {strategy.global_step}", flush=True)
strategy.finish()
if strategy.is_chief:
    strategy.wait_for_workers()
    final = strategy.variables()
    print(f"ps metrics: {strategy.ps_metrics()}", flush=True)
    print(f"final: w: {final['w'].item():.4f}, b: {final['b'].item():.4f}", flush=True)
server.join()
