"""One slot's task under a real scheduler (tests/schedulers/test_launch_*.py): `strategy_from_env()` places it
(a ps task serves inside that call and exits 0), the chief and workers take a few steps of a linear fit and
print one `SLOT {json}` line: their host, task, the cluster they saw, the strategy and the global step.

    python _slot_task.py STEPS
"""

import json
import socket
import sys
import time

START = time.monotonic()

import torch

import towerflow

IMPORTED = time.monotonic() - START


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    strategy = towerflow.strategy_from_env()
    placed = time.monotonic() - START
    task = strategy.context
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    if strategy.name == "parameter_server" and strategy.is_chief:
        strategy.wait_for_workers()  # every worker's pushes are in: the final global step
    print("SLOT " + json.dumps({
        "host": socket.gethostname(), "job": task.identity.job_name, "index": task.identity.task_index, "cluster": task.identity.cluster,
        "rank": task.identity.rank, "world_size": task.identity.world_size, "strategy": strategy.name,
        "global_step": strategy.global_step, "chief": strategy.is_chief,
        "seconds": {"import": round(IMPORTED, 1), "placed": round(placed, 1), "trained": round(time.monotonic() - START, 1)},
    }), flush=True)
    strategy.shutdown()
    print(f"SHUTDOWN {task.identity.job_name}:{task.identity.task_index} at {time.monotonic() - START:.1f} s", flush=True)


if __name__ == "__main__":
    main()
