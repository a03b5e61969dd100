"""Hybrid training that a test kills a worker of, or restores onto another number of workers.

    towerflow launch --ps P --workers N --dense allreduce _hybrid_faults.py DIR STEPS [backward|checkpoint]

The model of `_hybrid_script.py` (two fixed tables and a hash table on the ps, dense layers all-reduced,
SGD with momentum on each worker) under a MonitoredTrainingSession checkpointing every 5 steps into
DIR/run. Each step's batch is a function of (global step, rank). After 12 steps of its own each
incarnation writes "PID GLOBAL_STEP" to DIR/<rank>.<restart>.pid. A restored chief prints the step it
resumed at and whether the dense values and the tables are the checkpoint's; every worker prints a hash
of its final dense parameters, and the chief saves its final values to DIR/end.<restart>.pt.

With `backward`, worker 1's first incarnation stops inside the backward pass of its 12th step (a gradient
hook, while DDP all-reduces); with `checkpoint`, the chief's first incarnation stops inside the write of
its step-20 checkpoint. Either writes "PID GLOBAL_STEP" to DIR/kill-me and waits there to be killed.
"""

import contextlib

import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F

import towerflow
from _hybrid_script import HASH_IDS, ROWS, Clicks, ended_with
from towerflow.session import CheckpointManager
from towerflow.session import checkpoint as _checkpoint

folder, steps = sys.argv[1], int(sys.argv[2])
moment = sys.argv[3] if len(sys.argv) > 3 else None
restart = int(os.environ.get("TOWERFLOW_RESTART_COUNT", "0"))


def wait_to_be_killed(step: int) -> None:
    with open(os.path.join(folder, "kill-me.tmp"), "w") as marker:
        marker.write(f"{os.getpid()} {step}")
    os.replace(os.path.join(folder, "kill-me.tmp"), os.path.join(folder, "kill-me"))
    time.sleep(60)
    sys.exit("_hybrid_faults: nobody killed this task where it waited within 60 s")


if moment == "checkpoint" and restart == 0 and os.environ.get("RANK") == "0":
    real_write = _checkpoint.atomic_write

    @contextlib.contextmanager
    def held_write(path, mode="wb"):
        with real_write(path, mode) as f:
            yield f
            if os.path.basename(path) == "ckpt-0000000020.pt":
                f.flush()
                wait_to_be_killed(20)

    _checkpoint.atomic_write = held_write
strategy = towerflow.strategy_from_env()
model = Clicks()
optimizer = torch.optim.SGD(model.dense_parameters(), lr=0.05, momentum=0.9)
model, optimizer = strategy.setup(model, optimizer, sparse_optimizer=towerflow.ps.SparseSGD(lr=0.5))
rank = strategy.replica_id
if moment == "backward" and restart == 0 and rank == 1:
    calls = []

    def in_backward(grad):
        calls.append(1)
        if len(calls) == 12:
            wait_to_be_killed(strategy.global_step)
        return grad

    strategy.unwrap(model).top.weight.register_hook(in_backward)


def train_step(x, cats, hashed, y):
    optimizer.zero_grad()
    loss = F.binary_cross_entropy_with_logits(model(x, cats, hashed), y)
    loss.backward()
    optimizer.step()
    return loss


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randint(0, ROWS, (8, 2), generator=g),
            torch.randint(0, HASH_IDS, (8, 2), generator=g) * 7919, (torch.rand(8, generator=g) < 0.3).double())


def dense_hash() -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in strategy.unwrap(model).dense_parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


logdir = os.path.join(folder, "run")
local = 0
with towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, logdir=logdir,
                                        hooks=[towerflow.StopAtStepHook(last_step=steps)], save_checkpoint_steps=5,
                                        log_step_count_steps=0, progress=False) as session:
    if session.restored is not None and strategy.is_chief:
        saved = CheckpointManager(logdir).load()[1]
        module = strategy.unwrap(model)
        dense_same = all(torch.equal(saved["model"][k], v) for k, v in module.state_dict().items())
        previous = os.path.join(folder, "end.0.pt")
        tables = strategy.table_values()
        tables_same = os.path.exists(previous) and all(
            torch.equal(v, torch.load(previous, weights_only=False)["table_values"][k]) for k, v in tables.items())
        ps_step = max(m["global_step"] for m in strategy.ps_metrics().values())
        print(f"restart {restart}: resumed at step {session.restored.step} on {strategy.num_replicas_in_sync} workers; "
              f"dense as checkpointed: {dense_same}; tables as at the end of the first run: {tables_same}; "
              f"ps global step {ps_step}", flush=True)
    while not session.should_stop():
        session.run(train_step, *batch(session.global_step))
        local += 1
        if local == 12:
            name = os.path.join(folder, f"{rank}.{restart}.pid")
            with open(name + ".tmp", "w") as f:
                f.write(f"{os.getpid()} {session.global_step}")
            os.replace(name + ".tmp", name)
        time.sleep(0.02)
print(f"rank {rank} final dense {dense_hash()} at step {strategy.global_step}", flush=True)
if strategy.is_chief:
    strategy.wait_for_workers()
    end = ended_with(strategy, model)
    end["table_values"] = strategy.table_values()
    torch.save(end, os.path.join(folder, f"end.{restart}.pt"))
strategy.shutdown()
