"""All-reduce training that a test kills a replica of: python _ft_allreduce.py DIR STEPS [checkpoint]

Under `towerflow launch --workers 2`. Each step's batch is a function of (global step, rank),
so a run resumed from a checkpoint sees exactly the batches of an uninterrupted one. After 15
steps of its own (past the step-10 checkpoint), each incarnation writes "PID GLOBAL_STEP" to
DIR/<rank>.<restart>.pid. The chief prints a SHA-256 of the final parameters' bytes (float64).

With `checkpoint`, the chief's first incarnation stops inside the write of its step-20 checkpoint
(the payload written to the temporary file, not yet renamed into place), writes "PID 20" to
DIR/kill-me and waits there to be killed.
"""

import contextlib
import hashlib
import os
import sys
import time

import torch
from torch import nn

import towerflow
from towerflow.session import checkpoint as _checkpoint

folder, steps = sys.argv[1], int(sys.argv[2])
restart = int(os.environ.get("TOWERFLOW_RESTART_COUNT", "0"))
if sys.argv[3:] == ["checkpoint"] and restart == 0 and os.environ.get("RANK") == "0":
    real_write = _checkpoint.atomic_write

    @contextlib.contextmanager
    def held_write(path, mode="wb"):
        with real_write(path, mode) as f:
            yield f
            if os.path.basename(path) == "ckpt-0000000020.pt":
                f.flush()
                with open(os.path.join(folder, "kill-me.tmp"), "w") as marker:
                    marker.write(f"{os.getpid()} 20")
                os.replace(os.path.join(folder, "kill-me.tmp"), os.path.join(folder, "kill-me"))
                time.sleep(60)
                sys.exit("_ft_allreduce: nobody killed the chief inside its checkpoint write within 60 s")

    _checkpoint.atomic_write = held_write
torch.manual_seed(0)
strategy = towerflow.strategy_from_env()
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = strategy.setup(model, optimizer)


def train_step(x, y):
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss


local = 0
with towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, logdir=os.path.join(folder, "run"),
                                        hooks=[towerflow.StopAtStepHook(last_step=steps)], save_checkpoint_steps=10,
                                        log_step_count_steps=0, progress=False) as session:
    if session.restored is not None:
        print(f"rank {strategy.replica_id} (restart {restart}) resumed at step {session.restored.step}", flush=True)
    while not session.should_stop():
        g = torch.Generator().manual_seed(1000 * session.global_step + strategy.replica_id)
        x = torch.randn(16, 8, generator=g, dtype=torch.float64).to(strategy.device)
        session.run(train_step, x, x.sum(1, keepdim=True).sin())
        local += 1
        if local == 15:
            name = os.path.join(folder, f"{strategy.replica_id}.{restart}.pid")
            with open(name + ".tmp", "w") as f:
                f.write(f"{os.getpid()} {session.global_step}")
            os.replace(name + ".tmp", name)
        time.sleep(0.02)
if strategy.is_chief:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    print(f"final: sha256 {hashlib.sha256(flat.numpy().tobytes()).hexdigest()}", flush=True)
strategy.shutdown()
