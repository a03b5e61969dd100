"""Parameter-server benchmarks: wire throughput, overlap, scaling, and loss against time per mode.

    python benchmarks/ps_bench.py                 # every part; prints tables, writes benchmarks/results/ps_bench.json
    python benchmarks/ps_bench.py --parts wire    # one part: wire | loops | scaling | modes

Each part runs as its own local cluster (`towerflow launch --ps 1 --workers N` of this
script); inside the cluster, ps tasks serve and worker 0 measures and writes JSON.

* wire: one push + one pull of S MB through the strategy (S = 4, 16, 64) against raw loopback
  TCP in the same run (a socket echo of S MB each way to the ps task, reused buffers), in
  alternating blocks of 4 back-to-back ops each; the ratio is over the ops after a block's first
  (sustained throughput), `cold_ratio` over the first ones; with the page faults and CPU seconds
  of both processes per step.
* --env-variants plain,thp,...: run the wire and loops parts once per process environment
  (`WIRE_ENVS`: PyTorch's huge-page allocation, glibc malloc knobs), interleaved, --launches
  times over; each launch is its own cluster, so each variant's ratio to TCP is from its own run.
* loops: async steps/s of ParameterServerStrategy (prefetch on) against a minimal hand-written
  pull -> gradient -> push loop over the same transport, for a ~85k and a ~17M parameter MLP.
* scaling: total async steps/s with 1, 2 and 4 workers (small model).
* modes: training loss against wall time for async, sync and ssp (k=2) on MNIST-t10k (or
  digits), 2 workers, one of them slowed; writes docs/img/ps_modes.png.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

_NO_TRIM = {"MALLOC_TRIM_THRESHOLD_": str(1 << 32), "MALLOC_TOP_PAD_": str(64 << 20)}  # keep freed memory mapped
# Process environments the wire and loops parts compare (--env-variants); set for every task of the launch.
_SYSTEM = {"TOWERFLOW_PS_ALLOCATOR": "system"}  # without it, towerflow launch adds its allocator settings
WIRE_ENVS = {
    # what towerflow launch gives a ps cluster: huge pages for CPU tensors >= 2 MB, glibc's mmap threshold
    # fixed at 32 MB with 256 MB of freed memory kept, and TensorPipe's TCP transport only
    "tuned": {},  # includes the same-host shared-memory link for the steps
    "rpc": {"TOWERFLOW_PS_LINK": "zmq"},  # the launcher's settings, steps over RPC (what "tuned" was before the same-host link)
    "thp": {**_SYSTEM, "THP_MEM_ALLOC_ENABLE": "1"},  # huge pages only (what the launcher gave before 2026-11-22 13:50)
    "plain": {**_SYSTEM, "THP_MEM_ALLOC_ENABLE": "0"},  # the system's allocator as it is
    # TensorPipe's default transports, shm (busy-polling reactor) included, with huge pages: what tasks got
    # before towerflow chose uv
    "thp+shm": {**_SYSTEM, "THP_MEM_ALLOC_ENABLE": "1", "TOWERFLOW_RPC_TRANSPORTS": "uv,shm,ibv"},
    # glibc: big chunks from the heap, not mmap (the threshold is capped at 32 MB on 64-bit), freed memory kept
    "mmap32": {**_SYSTEM, "THP_MEM_ALLOC_ENABLE": "0", "MALLOC_MMAP_THRESHOLD_": str(32 << 20), **_NO_TRIM},
    # glibc: one arena (TensorPipe's threads allocate in the main heap too) and no mmap at all, freed memory kept
    "arena1": {**_SYSTEM, "THP_MEM_ALLOC_ENABLE": "0", "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", **_NO_TRIM},
    "thp+arena1": {**_SYSTEM, "THP_MEM_ALLOC_ENABLE": "1", "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", **_NO_TRIM},
}


# ---------------------------------------------------------------- models
def small_mlp() -> nn.Module:  # 85,614 parameters
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 64), nn.ReLU(), nn.Linear(64, 10))


def large_mlp() -> nn.Module:  # 16,874,506 parameters
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 3328), nn.ReLU(), nn.Linear(3328, 10))


class Blob(nn.Module):
    """One flat parameter of a given size: what the wire part pushes and pulls."""

    def __init__(self, numel: int):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(numel))


# ---------------------------------------------------------------- ps-side helpers for the baselines
_echo_port = None
_hand = {}


def _start_echo() -> int:
    """On the ps: a loopback TCP echo server (reused buffer), for the raw-TCP baseline; returns its port."""
    global _echo_port
    if _echo_port is None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        _echo_port = srv.getsockname()[1]

        def serve():
            buf = bytearray(1 << 20)
            while True:  # one connection per size
                conn, _ = srv.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    header = conn.recv(8, socket.MSG_WAITALL)
                    if len(header) < 8:
                        conn.close()
                        break
                    n = int.from_bytes(header, "little")
                    if n > len(buf):
                        buf = bytearray(n)
                    view = memoryview(buf)
                    got = 0
                    while got < n:
                        got += conn.recv_into(view[got:n])
                    conn.sendall(view[:n])

        threading.Thread(target=serve, daemon=True).start()
    return _echo_port


def _rusage():
    """This process so far: CPU seconds (user + system, all threads), minor page faults, and the CPU
    seconds of TensorPipe's shared-memory reactor threads (they busy-poll, so they burn CPU while idle)."""
    import glob
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    spin = 0
    for stat in glob.glob(f"/proc/{os.getpid()}/task/*/stat"):
        try:
            text = open(stat).read()
        except OSError:  # the thread ended
            continue
        if text[text.index("(") + 1:text.rindex(")")] == "TP_SHM_reactor":
            fields = text[text.rindex(")") + 2:].split()
            spin += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return r.ru_utime + r.ru_stime, r.ru_minflt, spin / os.sysconf("SC_CLK_TCK")


def _max_rss_kb() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _hand_init(values: torch.Tensor, lr: float) -> None:
    _hand["p"] = values.clone()
    _hand["lr"] = lr


def _hand_pull() -> torch.Tensor:
    return _hand["p"]


def _hand_push(grad: torch.Tensor) -> None:
    _hand["p"].sub_(grad, alpha=_hand["lr"])


def _by_name():
    """This file as the module `ps_bench`, so the ps resolves the helpers sent to it by name."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import ps_bench

    return ps_bench


# ---------------------------------------------------------------- parts (run on worker 0 inside the cluster)
def _timed(op) -> float:
    t = time.perf_counter()
    op()
    return time.perf_counter() - t


def part_wire(strategy, out: dict, burst: int = 4) -> None:
    """Push+pull through the strategy against a raw TCP echo, in alternating blocks of `burst`
    back-to-back ops each: the ratio of throughput is taken over the ops after the first of a block
    (sustained, as a training loop calls it), `cold_ratio` over the first ones (after the other
    side's block and the CPU accounting RPCs, the measure of runs before 2026-11-22 14:30 UTC)."""
    from towerflow.cluster.calls import endpoint

    me = _by_name()
    port = endpoint.call_async("ps:0", me._start_echo).wait()

    def usage():  # worker + ps: CPU seconds, page faults, reactor CPU seconds
        here, there = _rusage(), endpoint.call_async("ps:0", me._rusage).wait()
        return tuple(a + b for a, b in zip(here, there))

    rows = []
    for mb in (4, 16, 64):
        numel = mb * (1 << 20) // 4
        model = Blob(numel)
        s = type(strategy)(server=strategy.server, model_name=f"blob{mb}", mode="async")
        model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
        model.p.grad = torch.zeros(numel)
        rounds = max(11, 160 // mb)
        buf = bytearray(numel * 4)  # raw TCP: send S bytes, get S bytes back, buffers allocated once
        view = memoryview(buf)
        ps_times, tcp_times, ps_cold, tcp_cold = [], [], [], []  # back-to-back ops; the first op of each block
        cost = {"ps": [0.0, 0, 0.0], "tcp": [0.0, 0, 0.0]}  # CPU s, page faults, reactor CPU s (both processes)
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def echo():
                c.sendall(len(buf).to_bytes(8, "little"))
                c.sendall(view)
                got = 0
                while got < len(buf):
                    got += c.recv_into(view[got:])

            for i in range(rounds + 2):  # interleaved blocks, the first two rounds are warm-up
                u0 = usage()
                ps_block = [_timed(lambda: s.client.push_pull(None)) for _ in range(burst)]
                u1 = usage()
                tcp_block = [_timed(echo) for _ in range(burst)]
                u2 = usage()
                if i >= 2:
                    ps_cold.append(ps_block[0])
                    tcp_cold.append(tcp_block[0])
                    ps_times.extend(ps_block[1:])
                    tcp_times.extend(tcp_block[1:])
                    for k, (a, b) in (("ps", (u0, u1)), ("tcp", (u1, u2))):
                        for j in range(3):
                            cost[k][j] += (b[j] - a[j]) / burst
        s.finish()
        ps_s, tcp_s = statistics.median(ps_times), statistics.median(tcp_times)
        rows.append({"MB": mb, "rounds": rounds, "burst": burst, "ps_push_pull_s": ps_s, "tcp_echo_s": tcp_s,
                     "ps_GBps": 2 * mb / 1024 / ps_s, "tcp_GBps": 2 * mb / 1024 / tcp_s, "ratio": tcp_s / ps_s,
                     "cold_ratio": statistics.median(tcp_cold) / statistics.median(ps_cold),
                     "ps_cold_s": statistics.median(ps_cold), "tcp_cold_s": statistics.median(tcp_cold),
                     "ps_cpu_s": cost["ps"][0] / rounds, "tcp_cpu_s": cost["tcp"][0] / rounds,
                     "ps_faults": cost["ps"][1] / rounds, "tcp_faults": cost["tcp"][1] / rounds,
                     "ps_spin_s": cost["ps"][2] / rounds, "tcp_spin_s": cost["tcp"][2] / rounds,
                     "ps_times_s": ps_times, "tcp_times_s": tcp_times, "ps_cold_times_s": ps_cold,
                     "tcp_cold_times_s": tcp_cold})
    out["wire"] = rows


def _hand_loop(model: nn.Module, steps: int, lr: float) -> float:
    """The minimal loop: pull the flat values, load them, forward/backward, push the flat gradient."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from towerflow.cluster.calls import endpoint

    me = _by_name()
    endpoint.call_async("ps:0", me._hand_init, args=(parameters_to_vector(model.parameters()).detach(), lr)).wait()
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()

    def one():
        values = endpoint.call_async("ps:0", me._hand_pull).wait()
        vector_to_parameters(values, model.parameters())
        model.zero_grad()
        loss_fn(model(x), y).backward()
        endpoint.call_async("ps:0", me._hand_push, args=(parameters_to_vector([p.grad for p in model.parameters()]),)).wait()

    for _ in range(3):
        one()
    t = time.perf_counter()
    for _ in range(steps):
        one()
    return steps / (time.perf_counter() - t)


def _strategy_loop(strategy, name: str, model: nn.Module, steps: int, lr: float, prefetch: bool = True) -> float:
    s = type(strategy)(server=strategy.server, model_name=name, mode="async", prefetch=prefetch)
    model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()

    def one():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):
        one()
    global _window
    wall = time.time()
    t = time.perf_counter()
    for _ in range(steps):
        one()
    rate = steps / (time.perf_counter() - t)
    _window = (wall, time.time())
    s.finish()
    return rate


def part_loops(strategy, out: dict) -> None:
    rows = []
    for label, build, steps in (("small (85k)", small_mlp, 300), ("large (16.9M)", large_mlp, 30)):
        torch.manual_seed(0)
        hand = _hand_loop(build(), steps, 0.01)
        ps_plain = _strategy_loop(strategy, f"{label}-plain", build(), steps, 0.01, prefetch=False)
        ps_prefetch = _strategy_loop(strategy, f"{label}-prefetch", build(), steps, 0.01, prefetch=True)
        rows.append({"model": label, "hand_steps_s": hand, "ps_steps_s": ps_plain, "ps_prefetch_steps_s": ps_prefetch,
                     "speedup": ps_prefetch / hand})
    from towerflow.cluster.calls import endpoint

    ps_rss = endpoint.call_async("ps:0", _by_name()._max_rss_kb).wait()
    for r in rows:  # peak resident memory of the worker and the ps over the whole part
        r["worker_max_rss_kb"], r["ps_max_rss_kb"] = _max_rss_kb(), ps_rss
    out["loops"] = rows


_window = (0.0, 0.0)  # wall-clock span of the last timed loop


def part_scaling(strategy, out: dict, steps: int = 500) -> None:
    rate = _strategy_loop(strategy, "scaling", small_mlp(), steps, 0.01, prefetch=True)
    # wall clock: the driver takes the span from the first worker's start to the last one's end
    out["scaling"] = {"worker": strategy.replica_id, "steps_s": rate, "steps": steps, "start": _window[0], "end": _window[1]}


def part_modes(strategy, out: dict, data: str, steps: int, slow: float) -> None:
    from towerflow.data import load_mnist_or_digits

    split = load_mnist_or_digits(data)
    side = split.train.tensors[0].shape[-1]
    curves = {}
    for mode, opts in (("async", {}), ("sync", {}), ("ssp", {"staleness": 2})):
        torch.manual_seed(0)
        s = type(strategy)(server=strategy.server, model_name=f"mode-{mode}", mode=mode, **opts)
        model = nn.Sequential(nn.Flatten(), nn.Linear(side * side, 100), nn.ReLU(), nn.Linear(100, 10))
        model, opt = s.setup(model, torch.optim.Adam(model.parameters(), lr=2e-3))
        loader = s.distribute_loader(split.train, global_batch_size=64, seed=0)
        loss_fn = nn.CrossEntropyLoss()
        t0 = time.perf_counter()
        points = []
        for x, y in loader.forever():
            if s.global_step >= steps:
                break
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            if slow and s.replica_id == 1:
                time.sleep(slow)
            opt.step()
            points.append((time.perf_counter() - t0, float(loss), s.global_step))
        s.finish()
        curves[mode] = {"points": points, "metrics": s.metrics()}
    out["modes"] = {"worker": strategy.replica_id, "curves": curves}


# ---------------------------------------------------------------- inside the cluster
def in_cluster(args) -> None:
    import towerflow

    strategy = towerflow.ParameterServerStrategy(mode="async")  # chief and workers; the launcher has the ps serve
    out: dict = {"worker": strategy.replica_id}
    if args.part == "wire" and strategy.is_chief:
        part_wire(strategy, out)
    elif args.part == "loops" and strategy.is_chief:
        part_loops(strategy, out)
    elif args.part == "scaling":
        part_scaling(strategy, out)
    elif args.part == "modes":
        part_modes(strategy, out, args.data, args.mode_steps, args.slow)
    with open(os.path.join(args.out, f"{args.part}-{strategy.replica_id}.json"), "w") as f:
        json.dump(out, f)
    strategy.shutdown()


# ---------------------------------------------------------------- the driver
def launch(part: str, workers: int, out: str, extra, env_extra=None) -> list:
    cmd = [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", str(workers), os.path.abspath(__file__),
           "--in-cluster", "--part", part, "--out", out, *extra]
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), **(env_extra or {})}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{part} with {workers} workers failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return [json.load(open(os.path.join(out, f"{part}-{w}.json"))) for w in range(workers)]


def _print_wire(rows: list, label: str = "") -> None:
    for r in rows:
        print(f"  {label}{r['MB']:3d} MB: ps {r['ps_GBps']:.2f} GB/s ({r['ps_push_pull_s'] * 1e3:.1f} ms), "
              f"tcp {r['tcp_GBps']:.2f} GB/s ({r['tcp_echo_s'] * 1e3:.1f} ms), ps/tcp {r['ratio']:.2f} "
              f"(first op of a block: {r['cold_ratio']:.2f}); per step: cpu {r['ps_cpu_s'] * 1e3:.0f} / {r['tcp_cpu_s'] * 1e3:.0f} ms "
              f"(reactor spin {r.get('ps_spin_s', 0) * 1e3:.0f} / {r.get('tcp_spin_s', 0) * 1e3:.0f}), "
              f"page faults {r['ps_faults']:.0f} / {r['tcp_faults']:.0f}", flush=True)


def run_variants(parts: list, variants: list, launches: int, out: str, extra) -> dict:
    """The wire and loops parts under each process environment, interleaved, `launches` times over."""
    runs: dict = {v: {"env": WIRE_ENVS[v], **{k: [] for p in parts for k in (p, f"{p}_load_average")}} for v in variants}
    for i in range(launches):
        for v in variants:
            for part in parts:
                runs[v][f"{part}_load_average"].append(os.getloadavg()[0])
                rows = launch(part, 1, out, extra, WIRE_ENVS[v])[0][part]
                runs[v][part].append(rows)
                print(f"launch {i + 1}/{launches}, {v} (load {runs[v][f'{part}_load_average'][-1]:.1f}), {part}:", flush=True)
                if part == "wire":
                    _print_wire(rows)
                else:
                    for r in rows:
                        print(f"  {r['model']}: hand {r['hand_steps_s']:.1f}, ps {r['ps_steps_s']:.1f}, ps+prefetch "
                              f"{r['ps_prefetch_steps_s']:.1f} steps/s; peak RSS worker {r['worker_max_rss_kb'] / 1024:.0f} MB, "
                              f"ps {r['ps_max_rss_kb'] / 1024:.0f} MB", flush=True)
    median = statistics.median
    print("medians over launches:")
    for v, run in runs.items():
        if run.get("wire"):
            run["wire_median"] = {str(r["MB"]): {k: median(launch_rows[j][k] for launch_rows in run["wire"])
                                                  for k in ("ratio", "cold_ratio", "ps_push_pull_s", "tcp_echo_s",
                                                            "ps_faults", "ps_cpu_s", "tcp_cpu_s", "ps_spin_s", "tcp_spin_s")}
                                  for j, r in enumerate(run["wire"][0])}
            print(f"  {v:10s} wire ps/tcp: " + ", ".join(f"{mb} MB {m['ratio']:.2f}" for mb, m in run["wire_median"].items())
                  + " (each launch: " + "; ".join(", ".join(f"{r['ratio']:.2f}" for r in rows) for rows in run["wire"]) + ")")
        if run.get("loops"):
            run["loops_median"] = {r["model"]: {k: median(launch_rows[j][k] for launch_rows in run["loops"])
                                                for k in ("hand_steps_s", "ps_steps_s", "ps_prefetch_steps_s",
                                                          "worker_max_rss_kb", "ps_max_rss_kb")}
                                   for j, r in enumerate(run["loops"][0])}
            print(f"  {v:10s} loops steps/s (hand, ps, ps+prefetch): " + ", ".join(
                f"{m}: {x['hand_steps_s']:.1f}, {x['ps_steps_s']:.1f}, {x['ps_prefetch_steps_s']:.1f}"
                for m, x in run["loops_median"].items()))
    return runs


def plot_modes(results: list, path: str) -> None:
    from towerflow.monitoring.report import plot_curves

    chief = next(r for r in results if r["worker"] == 0)["modes"]["curves"]
    curves = {{"ssp": "ssp (k=2)"}.get(mode, mode): [(p[0], p[1]) for p in curve["points"]] for mode, curve in chief.items()}
    plot_curves(path, "1 ps + 2 workers, worker 1 slowed", "seconds", "training loss (chief, mean of 20 steps)",
                curves, smooth=20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="wire,loops,scaling,modes")
    p.add_argument("--data", default=os.environ.get("TOWERFLOW_DATA", os.path.join(REPO, "..", "shared", "data", "mnist-t10k")))
    p.add_argument("--mode-steps", type=int, default=400)
    p.add_argument("--slow", type=float, default=0.02, help="seconds worker 1 sleeps per step in the modes part")
    p.add_argument("--env-variants", default=None, metavar="LIST",
                   help=f"run the wire and loops parts under each of these process environments: {', '.join(WIRE_ENVS)}")
    p.add_argument("--launches", type=int, default=1, help="with --env-variants: launches per variant, interleaved")
    p.add_argument("--in-cluster", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args()
    if args.in_cluster:
        return in_cluster(args)
    os.makedirs(RESULTS, exist_ok=True)
    import tempfile

    out = tempfile.mkdtemp(prefix="ps-bench-")
    extra = ["--data", args.data, "--mode-steps", str(args.mode_steps), "--slow", str(args.slow)]
    path = os.path.join(RESULTS, "ps_bench.json")
    summary = json.load(open(path)) if os.path.exists(path) else {}  # parts run now replace their old numbers
    summary["machine"] = f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    summary.setdefault("load_average", {})
    parts = args.parts.split(",")
    for part in parts:
        summary["load_average"][part] = os.getloadavg()[0]
    if args.env_variants:
        variants = args.env_variants.split(",")
        unknown = [v for v in variants if v not in WIRE_ENVS]
        if unknown:
            raise SystemExit(f"unknown --env-variants {unknown}; choose from {', '.join(WIRE_ENVS)}")
        runs = run_variants([p for p in parts if p in ("wire", "loops")], variants, args.launches, out, extra)
        for v, run in runs.items():  # a later run of one part keeps the other part's numbers
            summary.setdefault("env_variants", {}).setdefault(v, {}).update(run)
        parts = [p for p in parts if p not in ("wire", "loops")]
    if "wire" in parts:
        summary["wire"] = launch("wire", 1, out, extra)[0]["wire"]
        print("push+pull through the ps vs raw loopback TCP echo (same run):")
        _print_wire(summary["wire"])
    if "loops" in parts:
        summary["loops"] = launch("loops", 1, out, extra)[0]["loops"]
        print("async steps/s, 1 worker: hand-written pull->grad->push vs ParameterServerStrategy:")
        for r in summary["loops"]:
            print(f"  {r['model']}: hand {r['hand_steps_s']:.1f}, ps {r['ps_steps_s']:.1f}, "
                  f"ps+prefetch {r['ps_prefetch_steps_s']:.1f} ({r['speedup']:.2f}x)")
    if "scaling" in parts:
        summary["scaling"] = {}
        for n in (1, 2, 4):
            rows = [r["scaling"] for r in launch("scaling", n, out, extra)]
            total = sum(r["steps"] for r in rows) / (max(r["end"] for r in rows) - min(r["start"] for r in rows))
            summary["scaling"][n] = {"total": total, "per_worker": [r["steps_s"] for r in rows]}
            print(f"  {n} workers: {total:.1f} steps/s in total over the common window "
                  "(each: " + ", ".join(f"{r['steps_s']:.1f}" for r in rows) + ")")
    if "modes" in parts:
        results = launch("modes", 2, out, extra)
        plot_modes(results, os.path.join(REPO, "docs", "img", "ps_modes.png"))
        summary["modes"] = {r["worker"]: {m: {**c["metrics"], "seconds": c["points"][-1][0] if c["points"] else 0,
                                              "final_loss": sum(p[1] for p in c["points"][-20:]) / max(1, len(c["points"][-20:]))}
                                          for m, c in r["modes"]["curves"].items()} for r in results}
        for mode, m in summary["modes"][0].items():
            print(f"  {mode}: {m['global_step']} global steps in {m['seconds']:.1f}s, chief loss {m['final_loss']:.3f}")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
