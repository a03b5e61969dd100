"""Seconds to 0.98 test accuracy on MNIST-t10k: one process against towerflow's ways to train
on several processes, and against a plain torch.distributed.rpc parameter-server loop.

    python benchmarks/time_to_accuracy.py --data ../shared/data/mnist-t10k             # 3 launches each
    python benchmarks/time_to_accuracy.py --data DIR --contenders one_process,ps_async --launches 5

Every contender trains examples/mnist_ps.py's CNN on the same 8,000 / 2,000 split of t10k with Adam at
a constant lr of 2e-3 and a global batch of 64 (split across the workers: 32 each), on this machine:

* one_process: plain PyTorch, one process, the torch threads the machine has.
* ddp_sync: `towerflow launch --workers 2`, MultiWorkerMirroredStrategy (DDP over gloo).
* ps_async: `towerflow launch --ps 1 --workers 2`, ParameterServerStrategy(mode="async").
* ps_async_prefetch: the same with prefetch=True.
* ps_geo: async with local_steps=4 (each worker takes 4 local Adam steps, then pushes the delta).
* ps_sync_backup: sync, replicas_to_aggregate=1 of 2 workers (one backup worker).
* rpc_loop: 1 ps + 2 workers, each step a torch.distributed.rpc pull, forward/backward, and a push
  that steps an Adam on the ps (the naive loop, no towerflow in the step).

The chief (worker 0) keeps a copy of its parameters every --every of its steps with the training
seconds so far (copies are off the clock, and so is evaluation: the copies are evaluated after the
run). A contender's time to accuracy is the first copy's time at which the test accuracy is >= the
target. Runs are interleaved (each launch runs every contender once); medians over launches are
reported. Writes benchmarks/results/time_to_accuracy.json and docs/img/time_to_accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
CONTENDERS = ("one_process", "ddp_sync", "ps_async", "ps_async_prefetch", "ps_geo", "ps_sync_backup", "rpc_loop")
LR, GLOBAL_BATCH, WORKERS = 2e-3, 64, 2


def build_model():
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from mnist_ps import build_model as example_model

    return example_model(28)


def load(data: str):
    from towerflow.data import load_mnist_or_digits

    return load_mnist_or_digits(data)


def batches(dataset, batch: int, seed: int):
    x, y = dataset.tensors
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y) - batch + 1, batch):
            idx = order[i:i + batch]
            yield x[idx], y[idx]


class Clock:
    """Training seconds, with the snapshots' own cost taken off."""

    def __init__(self, model, every: int):
        self.model, self.every, self.start, self.paused = model, every, time.perf_counter(), 0.0
        self.snapshots = []  # (training seconds, local step, state)

    def tick(self, step: int) -> None:
        if step % self.every:
            return
        t = time.perf_counter()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.snapshots.append((t - self.start - self.paused, step, state))
        self.paused += time.perf_counter() - t


def train_loop(model, opt, data, steps: int, clock: Clock, step_fn=None) -> None:
    for step in range(1, steps + 1):
        x, y = next(data)
        if step_fn is not None:
            step_fn(x, y)
        else:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if clock is not None:
            clock.tick(step)


# ---------------------------------------------------------------- the plain RPC loop's ps side (called by name)
_hand: dict = {}
_hand_lock = threading.Lock()


def _by_name():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import time_to_accuracy

    return time_to_accuracy


def _hand_init(values: torch.Tensor) -> None:
    with _hand_lock:
        if "p" not in _hand:
            _hand["p"] = values.clone().requires_grad_(True)
            _hand["opt"] = torch.optim.Adam([_hand["p"]], lr=LR)


def _hand_pull() -> torch.Tensor:
    return _hand["p"].detach()


def _hand_push(grad: torch.Tensor) -> None:
    with _hand_lock:  # one update at a time, as towerflow's ps
        _hand["p"].grad = grad
        _hand["opt"].step()


def rpc_loop_step(model):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from towerflow.cluster.calls import endpoint

    me = _by_name()
    endpoint.call_async("ps:0", me._hand_init, args=(parameters_to_vector(model.parameters()).detach(),)).wait()

    def step(x, y):
        vector_to_parameters(endpoint.call_async("ps:0", me._hand_pull).wait(), model.parameters())
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grad = parameters_to_vector([p.grad for p in model.parameters()])
        endpoint.call_async("ps:0", me._hand_push, args=(grad,)).wait()

    return step


# ---------------------------------------------------------------- inside a contender's process
def run_contender(args) -> None:
    import towerflow

    torch.manual_seed(0)
    split = load(args.data)
    c = args.contender
    if c == "one_process":
        model = build_model()
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        clock = Clock(model, args.every)
        train_loop(model, opt, batches(split.train, GLOBAL_BATCH, 0), args.steps, clock)
        return _save(args, clock)
    if c == "rpc_loop":
        server = towerflow.Server()
        torch.set_num_threads(server.cluster.threads_per_local_task(os.cpu_count() or 1))  # as towerflow's tasks
        model = build_model()
        step_fn = rpc_loop_step(model)
        clock = Clock(model, args.every) if server.task_index == 0 else None
        train_loop(model, None, batches(split.train, GLOBAL_BATCH // WORKERS, server.task_index),
                   args.steps // WORKERS, clock, step_fn)
        if clock is not None:
            _save(args, clock)
        return server.join()
    if c == "ddp_sync":
        strategy = towerflow.MultiWorkerMirroredStrategy()
    else:
        options = {"ps_async": {}, "ps_async_prefetch": {"prefetch": True}, "ps_geo": {"local_steps": 4},
                   "ps_sync_backup": {"mode": "sync", "replicas_to_aggregate": 1}}[c]
        strategy = towerflow.ParameterServerStrategy(**{"mode": "async", **options})
    model = build_model()
    model, opt = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    clock = Clock(strategy.unwrap(model) if hasattr(strategy, "unwrap") else model, args.every) if strategy.is_chief else None
    train_loop(model, opt, batches(split.train, GLOBAL_BATCH // WORKERS, strategy.replica_id), args.steps // WORKERS, clock)
    if clock is not None:
        _save(args, clock)
    strategy.shutdown()


def _save(args, clock: Clock) -> None:
    torch.save(clock.snapshots, os.path.join(args.out, f"{args.contender}.pt"))


# ---------------------------------------------------------------- the driver
def command(contender: str, args, out: str) -> list:
    own = [os.path.abspath(__file__), "--in-run", "--contender", contender, "--data", args.data, "--steps",
           str(args.steps), "--every", str(args.every), "--out", out]
    if contender == "one_process":
        return [sys.executable, *own]
    ps = [] if contender == "ddp_sync" else ["--ps", "1"]
    return [sys.executable, "-m", "towerflow", "launch", *ps, "--workers", str(WORKERS), *own]


@torch.no_grad()
def curve(snapshots: list, test) -> list:
    model = build_model()
    x, y = test.tensors
    out = []
    for seconds, step, state in snapshots:
        model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
        model.eval()
        acc = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum()) for i in range(0, len(y), 1000)) / len(y)
        out.append((seconds, step, acc))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "mnist-t10k"))
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--steps", type=int, default=800, help="global batches of 64 per run (all workers together)")
    p.add_argument("--every", type=int, default=10, help="the chief's steps between parameter copies")
    p.add_argument("--target", type=float, default=0.98)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=os.path.join(REPO, "docs", "img", "time_to_accuracy.png"))
    p.add_argument("--in-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.in_run:
        return run_contender(args)
    if not os.path.isdir(args.data):
        raise SystemExit(f"--data {args.data}: no such folder; give the folder of MNIST's t10k IDX files")
    contenders = args.contenders.split(",")
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        raise SystemExit(f"--contenders: unknown {bad}; expected some of {', '.join(CONTENDERS)}")
    test = load(args.data).test
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
    runs = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.launches):
            for c in contenders:
                proc = subprocess.run(command(c, args, tmp), env=env, capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    raise SystemExit(f"{c} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                points = curve(torch.load(os.path.join(tmp, f"{c}.pt")), test)
                reached = next((s for s, _, a in points if a >= args.target), None)
                runs[c].append({"seconds_to_target": reached, "points": points, "load_average": os.getloadavg()[0]})
                said = f"{reached:.1f} s" if reached is not None else f"not reached (best {max(a for *_, a in points):.4f})"
                print(f"launch {i + 1}/{args.launches} {c:18s} {args.target}: {said}", flush=True)
    medians = {}
    for c, rs in runs.items():
        times = [r["seconds_to_target"] for r in rs]
        medians[c] = statistics.median(t if t is not None else float("inf") for t in times)
    print(f"median seconds to {args.target}:")
    for c, m in medians.items():
        ratios = ", ".join(f"{m / medians[o]:.2f}x {o}" for o in ("one_process", "ddp_sync", "rpc_loop")
                           if o in medians and o != c and medians[o] not in (0, float("inf")))
        print(f"  {c:18s} {m:6.1f} s  {ratios}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(args.out or os.path.join(RESULTS, "time_to_accuracy.json"), "w") as f:
        json.dump({"machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "args": vars(args),
                   "medians_s": {c: (m if m != float("inf") else None) for c, m in medians.items()}, "runs": runs}, f, indent=1)
    plot(runs, args.target, args.plot)


def plot(runs: dict, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for c, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["seconds_to_target"] if r["seconds_to_target"] is not None else float("inf"))
        median_run = ordered[len(ordered) // 2]  # the launch with the median time
        s, _, a = zip(*median_run["points"])
        ax.plot(s, a, label=c)
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylim(0.9, 1.0)
    ax.set_xlabel("training seconds (evaluation off the clock)")
    ax.set_ylabel("test accuracy (MNIST-t10k, 2,000 held out)")
    ax.set_title("Time to accuracy, the median launch of each contender")
    ax.legend()
    ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
