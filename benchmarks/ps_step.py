"""The ps step: towerflow's async ps against one process and a plain RPC loop,
and where one step's time and CPU go.

    python benchmarks/ps_step.py                       # every contender, interleaved, 3 launches each
    python benchmarks/ps_step.py --contenders ps_shm,ps_rpc --launches 5 --steps 2000

The issue's setup: an MLP 64-256-256-10 on scikit-learn's 8x8 digits, batch 32 per worker, SGD
(lr 0.05), one torch thread per process (OMP_NUM_THREADS=1 in every process of every contender).

* one_process: the plain PyTorch loop (zero_grad, forward, backward, step), one process.
* rpc_loop: 1 ps + 2 workers; each step pulls the flat values, computes, pushes the flat gradient,
  each a `torch.distributed.rpc` call to a function on the ps (the naive loop towerflow should beat).
* ps_rpc: towerflow's async ParameterServerStrategy, 1 ps + 2 workers, TOWERFLOW_PS_LINK=zmq.
* ps_shm: the same with the same-host shared-memory link (the default on one host).
* ps_shm_prefetch: ps_shm with prefetch=True (next values pulled while the worker computes).
* ps_hosts, ps_hosts_auth: 1 ps + 2 workers on three network-namespace hosts (root), encrypted (the
  default across hosts) and authenticated only.
* ps_rpc_before, ps_hosts_before, ps_hosts_before_tcp: the tree of --before-src (torch.distributed.rpc):
  on one host with TOWERFLOW_PS_LINK=zmq; across the namespace hosts; and across them with TensorPipe's
  tensors over TCP instead of CMA, as between machines (see _on_hosts).
* ps_shm_before: ps_shm in the tree of --before-src (any checkout: a change's cost on the one-host step).
* zmq_bare_local, zmq_bare_hosts: the ceiling, a ps written directly on pyzmq (no towerflow, no authentication,
  one zero-copy frame each way), on loopback and on the three namespace hosts (_bare_zmq_ps.py).

Multi-worker rates are totals: all workers' steps over the span from the first worker's start to the
last one's end. For the towerflow contenders worker 0 also reports a breakdown per step: compute
(forward + backward), packing, time waiting for the ps's reply, installing the values, the ps's own
time in the call (push: coordinator + optimizer; the reply), and the CPU seconds and voluntary
context switches per step of the worker and the ps. Writes benchmarks/results/ps_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
CONTENDERS = ("one_process", "rpc_loop", "ps_rpc", "ps_shm", "ps_shm_prefetch", "ps_hosts", "ps_hosts_auth",
              "ps_rpc_before", "ps_shm_before", "ps_hosts_before", "ps_hosts_before_tcp", "zmq_bare_local",
              "zmq_bare_hosts")
BATCH, LR = 32, 0.05
MODEL = os.environ.get("PS_STEP_MODEL", "small")  # small | large (set by --model for every process)


def mlp() -> nn.Module:  # small: 84,490 parameters; large: 16,874,506
    if MODEL == "large":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 3328), nn.ReLU(),
                             nn.Linear(3328, 10))
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batches(seed: int):
    """The digits, shuffled, in batches of BATCH, forever (the large model: fixed random batches of 784 features)."""
    from towerflow.data import load_mnist_or_digits

    if MODEL == "large":
        g = torch.Generator().manual_seed(seed)
        fixed = [(torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(8)]
        while True:
            yield from fixed

    x, y = load_mnist_or_digits(None).train.tensors
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y) - BATCH + 1, BATCH):
            idx = order[i:i + BATCH]
            yield x[idx], y[idx]


def _usage() -> tuple:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw, r.ru_maxrss


# ---------------------------------------------------------------- ps-side helpers (called by name over RPC)
_hand: dict = {}
_ps_timers = {"push_s": 0.0, "pull_s": 0.0, "calls": 0}


def _by_name():
    """This file as the module `ps_step`, so the ps resolves the helpers sent to it by name."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import ps_step

    return ps_step


def _hand_init(values: torch.Tensor) -> None:
    _hand.setdefault("p", values.clone())


def _hand_pull() -> torch.Tensor:
    return _hand["p"]


def _hand_push(grad: torch.Tensor) -> None:
    _hand["p"].sub_(grad, alpha=LR)


def _ps_usage() -> tuple:
    return _usage()


def _ps_instrument() -> None:
    """On the ps: time ShardService.push and .pull (what the ps itself does for a step)."""
    try:
        from towerflow.ps.server import service
    except ImportError:  # --before-src: a tree from before the ps package's split by side
        from towerflow.ps import service

    cls = service.ShardService
    if getattr(cls, "_timed", False):
        return
    push, pull = cls.push, cls.pull

    def timed_push(self, *a, **k):
        t = time.perf_counter()
        try:
            return push(self, *a, **k)
        finally:
            _ps_timers["push_s"] += time.perf_counter() - t
            _ps_timers["calls"] += 1

    def timed_pull(self, *a, **k):
        t = time.perf_counter()
        try:
            return pull(self, *a, **k)
        finally:
            _ps_timers["pull_s"] += time.perf_counter() - t

    cls.push, cls.pull, cls._timed = timed_push, timed_pull, True


def _ps_timers_now() -> dict:
    return dict(_ps_timers)


# ---------------------------------------------------------------- the loops
def one_process(steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    data = batches(0)

    def one():
        x, y = next(data)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        one()
    t0 = time.time()
    for _ in range(steps):
        one()
    return {"workers": [{"steps": steps, "start": t0, "end": time.time()}]}


def rpc_loop(worker: int, steps: int, warmup: int) -> dict:
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from towerflow.cluster.calls import endpoint

    me = _by_name()
    torch.manual_seed(0)
    model = mlp()
    endpoint.call_async("ps:0", me._hand_init, args=(parameters_to_vector(model.parameters()).detach(),)).wait()
    loss_fn = nn.CrossEntropyLoss()
    data = batches(worker)

    def one():
        x, y = next(data)
        vector_to_parameters(endpoint.call_async("ps:0", me._hand_pull).wait(), model.parameters())
        model.zero_grad()
        loss_fn(model(x), y).backward()
        endpoint.call_async("ps:0", me._hand_push, args=(parameters_to_vector([p.grad for p in model.parameters()]),)).wait()

    for _ in range(warmup):
        one()
    t0 = time.time()
    for _ in range(steps):
        one()
    return {"steps": steps, "start": t0, "end": time.time()}


def towerflow_loop(strategy_cls, worker: int, steps: int, warmup: int, prefetch: bool) -> dict:
    try:
        from towerflow.cluster.calls import endpoint
    except ImportError:  # --before-src: a tree from before the cluster's rooms
        from towerflow.cluster import transport as endpoint
    try:
        from towerflow.ps.worker import channel
    except ImportError:  # --before-src, as above
        from towerflow.ps import channel

    me = _by_name()
    strategy = strategy_cls(mode="async", prefetch=prefetch)
    torch.manual_seed(0)
    model = mlp()
    model, opt = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loss_fn = nn.CrossEntropyLoss()
    data = batches(worker)
    pack = {"s": 0.0}
    gather = channel.Channel.gather

    def timed_gather(self, k):
        t = time.perf_counter()
        try:
            return gather(self, k)
        finally:
            pack["s"] += time.perf_counter() - t

    channel.Channel.gather = timed_gather
    compute = step_s = 0.0

    def one():
        nonlocal compute, step_s
        x, y = next(data)
        t = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        compute += t1 - t
        step_s += time.perf_counter() - t1

    if worker == 0:
        endpoint.call_async("ps:0", me._ps_instrument).wait()
    for _ in range(warmup):
        one()
    compute = step_s = pack["s"] = 0.0
    def pull_wait() -> float:  # (a tree from before the client's cut kept it on the client)
        counters = getattr(strategy.client, "counters", None)
        return counters.pull_wait_s if counters is not None else strategy.client._pull_wait_s

    wait0 = pull_wait()
    ps0 = endpoint.call_async("ps:0", me._ps_timers_now).wait() if worker == 0 else None
    ps_u0 = endpoint.call_async("ps:0", me._ps_usage).wait() if worker == 0 else None
    u0 = _usage()
    t0 = time.time()
    for _ in range(steps):
        one()
    end = time.time()
    out = {"steps": steps, "start": t0, "end": end, "linked": any(ch.link is not None for ch in strategy.client.channels)}
    if worker == 0:
        u1 = _usage()
        ps1 = endpoint.call_async("ps:0", me._ps_timers_now).wait()
        ps_u1 = endpoint.call_async("ps:0", me._ps_usage).wait()
        wait = pull_wait() - wait0
        wall = end - t0
        out["per_step_us"] = {k: v / steps * 1e6 for k, v in {
            "wall": wall, "compute": compute, "step": step_s, "pack": pack["s"], "wait_reply_and_install": wait,
            "other_in_step": step_s - pack["s"] - wait, "worker_cpu": u1[0] - u0[0],
            "ps_push (all workers)": ps1["push_s"] - ps0["push_s"], "ps_pull (all workers)": ps1["pull_s"] - ps0["pull_s"],
            "ps_cpu (all workers)": ps_u1[0] - ps_u0[0]}.items()}
        out["per_step_switches"] = {"worker": (u1[1] - u0[1]) / steps, "ps (all workers)": (ps_u1[1] - ps_u0[1]) / steps}
        out["ps_calls"] = ps1["calls"] - ps0["calls"]
        out["peak_rss_mb"] = {"worker": u1[2] / 1024, "ps": ps_u1[2] / 1024}
    strategy.finish()
    return out


def in_cluster(args) -> None:
    import towerflow

    server = towerflow.Server()  # the launcher's task; ps tasks serve (the launcher runs them)
    worker = server.task_index
    if args.contender == "rpc_loop":
        out = rpc_loop(worker, args.steps, args.warmup)
    else:
        out = towerflow_loop(towerflow.ParameterServerStrategy, worker, args.steps, args.warmup,
                             prefetch=args.contender.endswith("prefetch"))
    server.join()
    with open(os.path.join(args.out, f"{args.contender}-{worker}.json"), "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------- the driver
def run_one(contender: str, args, out_dir: str) -> dict:
    src = args.before_src if "_before" in contender else os.path.join(REPO, "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", "PS_STEP_MODEL": args.model,
           "TOWERFLOW_PS_LINK": "zmq" if contender in ("ps_rpc", "ps_rpc_before") else "shm"}
    if contender.startswith("zmq_bare"):
        from _bare_zmq_ps import run

        return run(contender, args, out_dir, env)
    if contender.startswith("ps_hosts"):
        from _ps_hosts import on_hosts

        return on_hosts(os.path.abspath(__file__), args, out_dir, env, contender)
    if contender == "one_process":
        cmd = [sys.executable, os.path.abspath(__file__), "--one-process", "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--out", out_dir]
    else:
        cmd = [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", os.path.abspath(__file__),
               "--in-cluster", "--contender", contender, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--out", out_dir]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{contender} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if contender == "one_process":
        return json.load(open(os.path.join(out_dir, "one_process.json")))
    return {"workers": [json.load(open(os.path.join(out_dir, f"{contender}-{w}.json"))) for w in range(2)]}


def total_rate(result: dict) -> float:
    workers = result["workers"]
    span = max(w["end"] for w in workers) - min(w["start"] for w in workers)
    return sum(w["steps"] for w in workers) / span


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500, help="timed steps per worker")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--out", default=None)
    p.add_argument("--model", choices=("small", "large"), default="small")
    p.add_argument("--before-src", default=None, help="ps_rpc_before: the src/ of a checkout from before the change")
    p.add_argument("--in-cluster", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.in_cluster:
        return in_cluster(args)
    if args.one_process:
        torch.set_num_threads(1)
        with open(os.path.join(args.out, "one_process.json"), "w") as f:
            json.dump(one_process(args.steps, args.warmup), f)
        return
    contenders = args.contenders.split(",")
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        raise SystemExit(f"--contenders: unknown {bad}; expected some of {', '.join(CONTENDERS)}")
    if any("_before" in c for c in contenders) and not args.before_src:
        raise SystemExit("--contenders ps_rpc_before / ps_hosts_before / ps_hosts_before_tcp need --before-src DIR (e.g. a `git worktree add` of main's "
                         "commit before the change, then DIR/src)")
    runs = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.launches):
            for c in contenders:  # interleaved: each launch runs every contender once
                r = run_one(c, args, tmp)
                r["steps_per_s"] = total_rate(r)
                r["load_average"] = os.getloadavg()[0]
                runs[c].append(r)
                wire = (f", the ps host's wire {r['ps_host_wire_bytes'] / sum(w['steps'] for w in r['workers']) / 1e3:.0f} "
                        "KB per step") if "ps_host_wire_bytes" in r else ""
                rss = r["workers"][0].get("peak_rss_mb")
                rss = f", peak RSS worker {rss['worker']:.0f} MB, ps {rss['ps']:.0f} MB" if rss else ""
                print(f"launch {i + 1}/{args.launches} {c:16s} {r['steps_per_s']:8.1f} steps/s (load "
                      f"{r['load_average']:.1f}{wire}{rss})", flush=True)
    base = {c: statistics.median(r["steps_per_s"] for r in rs) for c, rs in runs.items()}
    summary = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "model": args.model,
               "medians_steps_per_s": base}
    print("medians (total steps/s):")
    for c, v in base.items():
        ratios = ", ".join(f"{v / base[o]:.2f}x {o}" for o in ("one_process", "rpc_loop") if o in base and o != c)
        print(f"  {c:16s} {v:8.1f}  {ratios}")
    for ref in ("one_process", "rpc_loop", "ps_shm", "ps_rpc_before", "ps_hosts_before", "ps_hosts_before_tcp",
                "zmq_bare_local", "zmq_bare_hosts"):  # each launch's own ratio (same minutes, same load), then the median
        if ref in runs:
            paired = {c: statistics.median(r["steps_per_s"] / b["steps_per_s"] for r, b in zip(rs, runs[ref]))
                      for c, rs in runs.items() if c != ref}
            summary[f"median_paired_ratio_to_{ref}"] = paired
            print(f"median of each launch's ratio to {ref}: " + ", ".join(f"{c} {v:.2f}" for c, v in paired.items()))
    for c, rs in runs.items():
        parts = [r["workers"][0].get("per_step_us") for r in rs if r["workers"][0].get("per_step_us")]
        if parts:
            med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
            summary.setdefault("breakdown_us", {})[c] = med
            print(f"  {c} worker 0 per step (us, medians): " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
            sw = [r["workers"][0]["per_step_switches"] for r in rs]
            print(f"  {c} context switches per step: " + ", ".join(
                f"{k} {statistics.median(s[k] for s in sw):.1f}" for k in sw[0]))
    os.makedirs(RESULTS, exist_ok=True)
    with open(args.out or os.path.join(RESULTS, "ps_step.json"), "w") as f:
        json.dump({"summary": summary, "runs": runs, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
