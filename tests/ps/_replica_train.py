"""A deterministic ps job whose chief kills ps tasks: python _replica_train.py DIR STEPS MODEL KILLS

Run under `towerflow launch --ps P --workers W --ps-replicas 2 --max-restarts N` (the mode from the
launcher). Every worker takes exactly STEPS steps on batches drawn from its own seeded generator, so
two runs push the same gradients in the same order (one worker async, or sync, which applies the
mean) and must end with the same ps values. MODEL: `dense` (a small MLP, Adam), `sparse` (an
EmbeddingBag whose rows live on the ps tasks, and a linear head), `hash` (a HashEmbedding admitting
an id on its second sighting, and a linear head) or `tables` (both tables, summed into one head). The chief checkpoints every 20
global steps (MonitoredTrainingSession) and, for each `STEP:TASK[+TASK...]` of KILLS (comma-separated,
or `none`), once its step STEP is done, SIGKILLs those ps tasks a random 0-5 ms later from a thread
(so the kill lands anywhere in the next steps: between calls, or with a push in flight); a TASK `chief`
kills the chief itself right after (as a host holding both would go down), once: not when restarted; a TASK
`cutN` leaves ps task N running but aborts every TCP connection to it (`ss -K`), and `stopN` freezes it (SIGSTOP: a
host that stops answering; a later kill of task N ends it, and the launcher restarts it); `createN` kills ps task N
right after the chief's next restore of lost ps tasks sent its first part (a second loss during a recovery);
`napS` makes the chief
sleep S seconds after the step (its sync partner waits on the ps that long); `wait` among them makes
the chief wait, after the kill, until the killed ps tasks have joined again (and for one look of its
worker's, which asks whether a part its backup serves can go back every LOOK_BACK_EVERY_S). Every worker
trains with `prefetch=True` when REPLICA_TRAIN_PREFETCH is set. The chief writes the final values, the ps tasks'
whole state (`optimizer.state_dict()`: values, optimizer and table state, clocks), the global step and its
recoveries to DIR/final.pt.
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import torch
from torch import nn

import towerflow
from towerflow.cluster import server
from towerflow.ps.worker import client as ps_client
from towerflow.ps.worker import recovery
from towerflow.ps.worker.recovery import LOOK_BACK_EVERY_S

folder, steps, model_kind, kills = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def ps_pid(task: int) -> int:
    """The live process of this launch's ps task `task` (same store address: the same launch)."""
    store = os.environ["TOWERFLOW_STORE"]
    want = {b"TOWERFLOW_JOB_NAME=ps", f"TOWERFLOW_TASK_INDEX={task}".encode(), f"TOWERFLOW_STORE={store}".encode()}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            return int(pid)
    raise RuntimeError(f"no live process of /job:ps/task:{task}")


def cut_connections(pid: int) -> None:
    """Abort every TCP connection to the ports process `pid` listens on (`ss -K`): the process lives on, cut off."""
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    ports = [line.split()[3].rsplit(":", 1)[1] for line in listening.splitlines() if f"pid={pid}," in line]
    for port in ports:
        subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", port], capture_output=True, check=True)
    print(f"_replica_train: cut the connections to pid {pid} (ports {ports})", flush=True)


armed = []  # ps tasks to kill once the chief's next restore sent its first part
restoring = False


def restore_ps(self):
    global restoring
    restoring = True
    try:
        return _restore_ps(self)
    finally:
        restoring = False


def create(self, *args, **kwargs):
    future = _create(self, *args, **kwargs)
    if restoring and armed:
        for task in armed:
            pid = ps_pid(task)
            os.kill(pid, signal.SIGKILL)
            print(f"_replica_train: killed ps task {task} (pid {pid}) after the restore sent its first part", flush=True)
        armed.clear()
    return future


_restore_ps, recovery.Recovery.restore_ps = recovery.Recovery.restore_ps, restore_ps
_create, ps_client.PSClient.create = ps_client.PSClient.create, create


def kill_soon(tasks) -> None:
    """SIGKILL those ps tasks a random 0-5 ms later (`cutN`: cut ps task N's connections instead); with "chief"
    among them, this process too, right after."""
    itself = "chief" in tasks
    armed.extend(int(t[6:]) for t in tasks if isinstance(t, str) and t.startswith("create"))
    cut = [ps_pid(int(t[3:])) for t in tasks if isinstance(t, str) and t.startswith("cut")]
    stop = [ps_pid(int(t[4:])) for t in tasks if isinstance(t, str) and t.startswith("stop")]
    tasks = [t for t in tasks if isinstance(t, int)]
    pids = [ps_pid(t) for t in tasks]

    def run() -> None:
        time.sleep(random.uniform(0, 0.005))
        for pid in cut:
            cut_connections(pid)
        for pid in stop:
            os.kill(pid, signal.SIGSTOP)
            print(f"_replica_train: stopped pid {pid}", flush=True)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        if pids or itself:
            print(f"_replica_train: killed ps tasks {tasks} (pids {pids}){' and the chief' if itself else ''}", flush=True)
        if itself:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=run, daemon=True).start()


class Sparse(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.table = nn.EmbeddingBag(64, 4, mode="sum", sparse=True, device=device)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.table(ids))


class Hashed(nn.Module):
    def __init__(self):
        super().__init__()
        self.ids = towerflow.ps.HashEmbedding(4, mode="sum", admit_after=2)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.ids(ids))


class BothTables(nn.Module):
    """A fixed table and a hash vocabulary in one step: the ids as they are, and far outside any fixed range."""

    def __init__(self, device):
        super().__init__()
        self.table = nn.EmbeddingBag(64, 4, mode="sum", sparse=True, device=device)
        self.ids = towerflow.ps.HashEmbedding(4, mode="sum", admit_after=2)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.table(ids) + self.ids(ids * 10**9 + 7))


def wait_restarted(before) -> None:
    """Block until each ps task of `before` ({task: its call name before the kill}) has joined again as a new
    incarnation (the training loop then finds it back at its next step)."""
    deadline = time.monotonic() + 60
    while any(server.current().call_name_of("ps", t) == name for t, name in before.items()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"ps tasks {sorted(before)} were not restarted within 60 s")
        time.sleep(0.05)


strategy = towerflow.strategy_from_env(**({"prefetch": True} if os.environ.get("REPLICA_TRAIN_PREFETCH") else {}))
torch.manual_seed(0)
if model_kind == "dense":
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
elif model_kind == "sparse":
    model = Sparse(strategy.table_device)
    model.table.init_std = 0.1
elif model_kind == "tables":
    model = BothTables(strategy.table_device)
    model.table.init_std = 0.1
else:
    model = Hashed()
model, optimizer = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
data = torch.Generator().manual_seed(100 + strategy.replica_id)
plan = {}
for item in ([] if kills == "none" else kills.split(",")):
    at, tasks = item.split(":")
    plan[int(at)] = [t if t in ("chief", "wait") or t.startswith(("cut", "stop", "nap", "create")) else int(t)
                     for t in tasks.split("+")]
if os.environ.get("TOWERFLOW_RESTART_COUNT", "0") != "0":
    plan = {}  # a restarted chief kills nothing again


def step(i: int) -> float:
    if model_kind == "dense":
        x = torch.randn(8, 8, generator=data)
        y = x.sum(1, keepdim=True).sin()
    else:
        x = torch.randint(0, 64, (8, 3), generator=data)
        y = (x % 7).float().mean(1, keepdim=True)
        x = x * 10**9 + 7 if model_kind == "hash" else x  # hash ids far outside any fixed range
    x, y = (x if model_kind != "dense" else x.to(strategy.device)), y.to(strategy.device)  # table ids: any device
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


with towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, logdir=os.path.join(folder, "ckpt"),
                                        save_checkpoint_steps=20, log_step_count_steps=0, progress=False) as session:
    for i in range(1, steps + 1):
        session.run(step, i)
        if strategy.is_chief and i in plan:
            restarting = {t: server.current().call_name_of("ps", t) for t in plan[i] if isinstance(t, int)}
            kill_soon([t for t in plan[i] if t != "wait" and not str(t).startswith("nap")])
            if "wait" in plan[i]:
                wait_restarted(restarting)
                time.sleep(LOOK_BACK_EVERY_S)  # the next step then looks whether a part's task is back
            for nap in (float(t[3:]) for t in plan[i] if str(t).startswith("nap")):
                time.sleep(nap)
if strategy.is_chief:
    final = strategy.wait_for_workers()
    out = {"global_step": final, "variables": strategy.variables(), "tables": strategy.table_values(),
           "ps_state": optimizer.state_dict(), "recoveries": strategy.recoveries}
    torch.save(out, os.path.join(folder, "final.pt.tmp"))
    os.replace(os.path.join(folder, "final.pt.tmp"), os.path.join(folder, "final.pt"))
    print(f"_replica_train: global step {final}; recoveries {strategy.recoveries}", flush=True)
strategy.shutdown()
