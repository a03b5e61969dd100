"""Run by tests/ps/test_cluster.py under `towerflow launch --ps 1 --workers 3`: several models trained
one after another on one cluster (one launch: torch starts once per task), each under one mode.

Every worker writes OUT/worker-<i>.json (its metrics per scenario); the chief also writes
OUT/chief.json (final variables and ps counters per scenario).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import towerflow

STEPS_EQUIV = 8
LR = 0.1


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def batch(step: int, worker: int, num_workers: int):
    x, y = data()
    start = ((step * num_workers + worker) * 8) % len(x)
    return x[start:start + 8], y[start:start + 8]


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def train(strategy, model, optimizer, stop, delay=0.0):
    """Steps until stop(strategy, steps_done) says so; the slowed worker sleeps `delay` per step."""
    steps = 0
    start = time.perf_counter()
    while not stop(strategy, steps):
        x, y = (t.to(strategy.device) for t in batch(steps, strategy.replica_id, strategy.num_replicas_in_sync))
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if delay:
            time.sleep(delay)
        optimizer.step()
        steps += 1
    elapsed = time.perf_counter() - start
    strategy.finish()
    return steps, elapsed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--delay", type=float, default=0.15)
    args, _ = p.parse_known_args()
    server = towerflow.Server()
    if server.job_name == "ps":
        server.join()
        return
    slow = server.task_index == 2
    mine, chief = {}, {}

    scenarios = [
        # name, strategy options, stop rule, slowed?
        ("sync_all", dict(mode="sync"), lambda s, n: n >= STEPS_EQUIV, False),
        ("sync_all_slow", dict(mode="sync"), lambda s, n: n >= 4, True),
        ("sync_backup", dict(mode="sync", replicas_to_aggregate=2), lambda s, n: s.global_step >= 30, True),
        ("ssp1", dict(mode="ssp", staleness=1, prefetch=True), lambda s, n: n >= 15, True),
        ("async", dict(mode="async", prefetch=True), lambda s, n: n >= 15, True),
    ]
    for name, options, stop, slowed in scenarios:
        strategy = towerflow.ParameterServerStrategy(server=server, model_name=name, **options)
        model = build_model()
        model, optimizer = strategy.setup(model, make_optimizer(model))
        steps, elapsed = train(strategy, model, optimizer, stop, args.delay if (slowed and slow) else 0.0)
        mine[name] = {**strategy.metrics(), "elapsed": elapsed, "steps": steps}
        if strategy.is_chief:
            final_step = strategy.wait_for_workers()
            if name == "sync_all":  # a checkpoint of the ps state round-trips through torch.save
                import io

                buf = io.BytesIO()
                torch.save(optimizer.state_dict(), buf)
                buf.seek(0)
                optimizer.load_state_dict(torch.load(buf, weights_only=False))
                chief["restored_step"] = strategy.global_step
            chief[name] = {
                "global_step": final_step,
                "variables": {k: v.tolist() for k, v in strategy.variables().items()},
                "ps": strategy.ps_metrics()["/job:ps/task:0"],
            }
    write_results(args.out, strategy.replica_id, mine, chief)
    server.join()


def write_results(out: str, replica: int, mine: dict, chief: dict) -> None:
    """OUT/worker-<i>.json (this worker's view) and, on the chief, OUT/chief.json: what the test reads."""
    with open(os.path.join(out, f"worker-{replica}.json"), "w") as f:
        json.dump(mine, f)
    if chief:
        with open(os.path.join(out, "chief.json"), "w") as f:
            json.dump(chief, f)


if __name__ == "__main__":
    main()
