"""Linear regression on a ps that a test kills a worker of: python _ft_train.py DIR STEPS [MOMENT]

The ps mode comes from the launcher (--mode, default async). Every worker trains until the
global step (on the ps) reaches STEPS, sleeping a little per step so that a kill lands
mid-training; after its first 20 steps each incarnation writes "PID GLOBAL_STEP" to
DIR/<job>:<index>.<restart>.pid. So that the restarted worker really continues however long
its restart takes, the chief also goes on until the ps has seen worker 1 rejoin and 200 more
steps have passed, and a restarted worker trains at least 50 steps (unless its earlier
incarnation had finished). The chief prints the fit.

MOMENT puts worker 1's first incarnation at a known point and writes "PID GLOBAL_STEP" to
DIR/kill-me when it is there, so that the test's SIGKILL lands exactly then (no sleep-and-hope):

* before_first_step: in the cluster (RPC joined), before setup: it waits there to be killed;
* finished: after finish() and with its done said (Server.join), while the chief trains on
  until it sees worker 1 rejoin (then stops: the rejoined worker trains no more);
* raise: worker 1's first incarnation raises after its first 20 steps (its own error, not a kill);
* joining, joining_served: worker 1's restarted incarnation (the test kills the first one after its
  20 steps) stops inside its join (slot claimed; its endpoint not serving yet, or serving and
  published) and writes "PID 0" to DIR/kill-me; it goes on once the test has killed another task
  and written DIR/killed;
* sync_round: the chief and worker 2 stop at their step 20 (until DIR/resume exists) and the chief
  writes "GLOBAL_STEP" to DIR/kill-me once worker 1's pull waits at the ps for a round they will
  not complete.
"""

import os
import sys
import threading
import time

import torch
from torch import nn

import towerflow

folder, steps = sys.argv[1], int(sys.argv[2])
moment = sys.argv[3] if len(sys.argv) > 3 else "step20"
HOLD_S = 60  # how long a task held at a moment waits for the test before giving up


def note(name: str, text: str) -> None:
    with open(os.path.join(folder, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))


def hold(what: str) -> None:
    """Wait here to be killed (a test that never does fails on this task's exit code)."""
    time.sleep(HOLD_S)
    sys.exit(f"_ft_train: nobody killed this task {what} within {HOLD_S} s")


def wait_for_file(name: str) -> None:
    deadline = time.monotonic() + HOLD_S
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            sys.exit(f"_ft_train: {name} never appeared in {folder}")
        time.sleep(0.05)


me = (os.environ.get("TOWERFLOW_JOB_NAME"), os.environ.get("TOWERFLOW_TASK_INDEX"))
restart = int(os.environ.get("TOWERFLOW_RESTART_COUNT") or 0)
server = towerflow.Server(start=False)
if moment.startswith("joining") and me == ("worker", "1") and restart > 0:  # hold the restarted worker in its join
    join_calls = server.membership.join_calls

    def held_join(*args, **kwargs):
        if moment == "joining":  # slot claimed, endpoint not serving yet
            note("kill-me", f"{os.getpid()} 0")
            wait_for_file("killed")
        replaced = join_calls(*args, **kwargs)
        if moment == "joining_served":  # endpoint serving and published, the others not seen up yet
            note("kill-me", f"{os.getpid()} 0")
            wait_for_file("killed")
        return replaced

    server.membership.join_calls = held_join
server.start()
if server.job_name == "ps":
    server.join()
    sys.exit(0)
is_target = (server.job_name, server.task_index, server.incarnation) == ("worker", 1, 0)
if moment == "before_first_step" and is_target:
    note("kill-me", f"{os.getpid()} 0")
    hold("before its first step")


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
x, y = x.to(strategy.device), y.to(strategy.device)
model = Line()
model, optimizer = strategy.setup(model, torch.optim.Adagrad(model.parameters(), lr=0.5))
order = torch.Generator().manual_seed(10 + strategy.replica_id + 100 * server.incarnation)
local = 0
rejoined_at = None  # chief: the global step when it saw worker 1 rejoin


def ps_view() -> dict:
    return strategy.ps_metrics()["/job:ps/task:0"]


def chief_waits() -> bool:
    global rejoined_at
    if not strategy.is_chief:
        return False
    if rejoined_at is None and local % 20 == 0:
        if ps_view()["rejoins_by_worker"].get(1):
            rejoined_at = strategy.global_step
    return rejoined_at is None or (moment != "finished" and strategy.global_step < rejoined_at + 200)


def pause_for_the_round() -> None:
    """sync_round: stop here; the chief says when worker 1 waits for a round that needs us."""
    if strategy.is_chief:
        deadline = time.monotonic() + HOLD_S
        while 1 not in ps_view()["waiting_pulls"]:
            if time.monotonic() > deadline:
                sys.exit("_ft_train: worker 1 never waited for a sync round")
            time.sleep(0.05)
        note("kill-me", str(strategy.global_step))
    wait_for_file("resume")


while not strategy.is_finished and (
        strategy.global_step < steps or chief_waits() or (server.incarnation > 0 and local < 50)):
    idx = torch.randint(0, len(x), (10,), generator=order)
    optimizer.zero_grad()
    ((model(x[idx]) - y[idx]) ** 2).mean().backward()
    optimizer.step()
    local += 1
    if local == 20:
        note(f"{server.job_name}:{server.task_index}.{server.incarnation}.pid", f"{os.getpid()} {strategy.global_step}")
        if moment == "raise" and is_target:
            raise RuntimeError("injected failure in worker 1")
        if moment == "sync_round" and strategy.replica_id in (0, 2) and server.incarnation == 0:
            pause_for_the_round()
    time.sleep(0.005)
print(f"worker {strategy.replica_id} (restart {server.incarnation}): {local} steps, global step {strategy.global_step}", flush=True)
strategy.finish()
if moment == "finished" and is_target:  # say where it is once its done is in the store
    def mark_when_done() -> None:
        while not server.rendezvous.is_marked("done"):
            time.sleep(0.01)
        note("kill-me", f"{os.getpid()} {strategy.global_step}")

    threading.Thread(target=mark_when_done, daemon=True).start()
if strategy.is_chief:
    strategy.wait_for_workers()
    final = strategy.variables()
    print(f"ps metrics: {strategy.ps_metrics()}", flush=True)
    print(f"final: w: {final['w'].item():.4f}, b: {final['b'].item():.4f}", flush=True)
server.join()
