"""What one call and one key cost the rendezvous store: the figures benchmarks/scaling_sim.py's model runs on.

    PYTHONPATH=src .venv/bin/python benchmarks/store_calibration.py [--etcd] [--load] [--seconds S] [--out FILE]

The embedded store: a torch TCPStore served (as `towerflow launch` serves it, `c10d.host_store`) by a process of
its own, called over loopback by one client in this process, so the server's CPU (read from its process) is the
store's alone. etcd (`--etcd`): /usr/bin/etcd started on free loopback ports, data on tmpfs, called through
towerflow's `EtcdStore` (its v3 JSON gateway), killed at the end. For each method (get, set, add, and check /
multi_get of 1 to 1,024 keys) it measures the client's wall time per call and the server's CPU per call, and fits
the batched methods' server CPU as `per call + per key * keys`. One client calls at a time: the server's CPU per
call is then an upper bound of what it spends under load (wake-ups are not shared), and 1 / (CPU per call) its
capacity on one core.

`--load`: the embedded store's CPU per call when N tasks call it as they do in the steady state (each task on a
connection of its own, each of its periodic calls on its own phase, its peer check's three calls one after the
other: TASK_CALLS), for N from 64 to 2,048: how many calls share a wake-up of the store's loop depends on their
rate and grouping, which the single-client figures bound but do not place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import psutil

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 16, 128, 1024)
_HOST = """
import sys, time
from towerflow.cluster.store import c10d
sock = c10d.listen("127.0.0.1", 0)
store = c10d.host_store(sock, 60)
print(store.port, flush=True)
while True:
    time.sleep(3600)
"""


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def measure(call: Callable[[], object], server: psutil.Process, seconds: float) -> Dict[str, float]:
    """Call `call` for about `seconds`: the client's wall and CPU µs per call and the server's CPU µs per call."""
    for _ in range(20):  # warm
        call()
    n, c0, t0, p0 = 0, _cpu(server), time.perf_counter(), time.process_time()
    while True:
        for _ in range(50):
            call()
        n += 50
        if time.perf_counter() - t0 >= seconds:
            break
    wall, cpu, client = time.perf_counter() - t0, _cpu(server) - c0, time.process_time() - p0
    return {"calls": n, "wall_us": 1e6 * wall / n, "server_cpu_us": 1e6 * cpu / n, "client_cpu_us": 1e6 * client / n}


def measure_spaced(call: Callable[[], object], server: psutil.Process, seconds: float, gap: float = 0.002) -> Dict[str, float]:
    """As `measure`, one call every `gap` s: a call that finds the server's loop asleep, as the calls of a cluster's
    tasks mostly do, costs it a wake-up on top (the back-to-back figure is the lower bound, this the upper)."""
    idle0, t0 = _cpu(server), time.perf_counter()
    time.sleep(min(1.0, seconds / 2))
    idle = (_cpu(server) - idle0) / (time.perf_counter() - t0)  # what the server spends with no call at all
    n, c0, t0 = 0, _cpu(server), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        call()
        n += 1
        time.sleep(gap)
    wall = time.perf_counter() - t0
    return {"calls": n, "gap_s": gap, "server_cpu_us": 1e6 * max(0.0, _cpu(server) - c0 - idle * wall) / n,
            "server_idle_cpu": idle}


def _fit(points: List[tuple]) -> Dict[str, float]:
    """Least squares of y = a + b * k over (k, y)."""
    ks, ys = [p[0] for p in points], [p[1] for p in points]
    mk, my = sum(ks) / len(ks), sum(ys) / len(ys)
    b = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / max(1e-12, sum((k - mk) ** 2 for k in ks))
    return {"per_call": max(0.0, my - b * mk), "per_key": max(0.0, b)}


def calibrate(store, server: psutil.Process, seconds: float, prefix: str = "beat/worker/") -> dict:
    keys = [f"{prefix}{i}" for i in range(max(BATCHES))]
    for k in keys:
        store.add(k, 1)
    store.set("coordinator", "x" * 64)
    out = {"get": measure(lambda: store.get("coordinator"), server, seconds),
           "set": measure(lambda: store.set("facts/x", "1"), server, seconds),
           "add": measure(lambda: store.add(keys[0], 0), server, seconds),
           "add_spaced": measure_spaced(lambda: store.add(keys[0], 0), server, seconds)}
    for method in ("check", "multi_get"):
        rows = {}
        for k in BATCHES:
            batch = keys[:k]
            fn = getattr(store, method)
            rows[str(k)] = measure(lambda: fn(batch), server, seconds / 2)
        out[method] = rows
        for what in ("wall_us", "server_cpu_us", "client_cpu_us"):
            out[f"{method}_{what}_fit"] = _fit([(k, rows[str(k)][what]) for k in BATCHES])
    return out


# what a worker of the group watch asks of the store, read off the code (benchmarks/scaling.py's counts by caller
# agree): (period s, calls one after the other). Its beat (an add, every BEAT_EVERY); its tick (one multi_get of
# lost/version and its watcher's beat and incarnation, every WATCH_EVERY); its peer check (done_version, the
# failure count, lost/version: three adds in a row, every CHECK_EVERY). Six calls per task per second.
TASK_CALLS = ((1.0, ("add",)), (0.5, ("multi_get",)), (1.0, ("add", "add", "add")))
CALLS_PER_TASK = sum(len(calls) / period for period, calls in TASK_CALLS)


def _tasks_calling(port: int, tasks: int, seed: int, ready, stop, counter, task_cpu: float = 0.0) -> None:
    """One load process: `tasks` store clients, each calling as a task does (TASK_CALLS, each on its own phase)
    once all are connected (`ready`), until `stop`; the calls made are counted in `counter`. `task_cpu`: what else
    a task spends of a core (s per s), spent in its periodic wake-ups as a task's threads spend it, so that the
    machine is as busy as under a cluster's tasks."""
    import heapq
    import random
    from concurrent.futures import ThreadPoolExecutor

    from towerflow.cluster.store import c10d

    rng = random.Random(seed)
    with ThreadPoolExecutor(16) as pool:  # a connect may wait on the name resolver (docs/cluster.md)
        clients = list(pool.map(lambda _: c10d.connect_store("127.0.0.1", port, 120), range(tasks)))
    keys = [f"beat/worker/{i}" for i in range(3)]
    for k in keys:
        clients[0].add(k, 1)
    ready.wait()
    now = time.monotonic()
    due = [(now + rng.uniform(0, period), t, i) for t in range(tasks) for i, (period, _) in enumerate(TASK_CALLS)]
    heapq.heapify(due)
    while not stop.is_set():
        when, t, i = heapq.heappop(due)
        pause = when - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        period, calls = TASK_CALLS[i]
        for method in calls:
            if method == "add":
                clients[t].add(keys[0], 0)
            else:
                clients[t].multi_get(keys)
        with counter.get_lock():  # counted as made: the window's rate is read off this counter at its two ends
            counter.value += len(calls)
        if task_cpu:
            spin_until = time.thread_time() + task_cpu * period / len(TASK_CALLS)
            while time.thread_time() < spin_until:
                pass
        heapq.heappush(due, (when + period, t, i))


def under_load(port: int, server: psutil.Process, tasks: int, seconds: float, procs: int = 8,
               task_cpu: float = 0.0) -> Dict[str, float]:
    """The store's CPU per call with `tasks` clients (spread over `procs` processes) calling as a cluster's tasks
    do, over `seconds` once every client is connected and calling."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    per = [c for c in (tasks // procs + (1 if i < tasks % procs else 0) for i in range(procs)) if c]
    ready, stop, counter = ctx.Barrier(len(per) + 1), ctx.Event(), ctx.Value("q", 0)
    workers = [ctx.Process(target=_tasks_calling, args=(port, c, i, ready, stop, counter, task_cpu)) for i, c in enumerate(per)]
    for w in workers:
        w.start()
    try:
        ready.wait(300)
        time.sleep(1.5)  # every phase under way
        c0, t0, busy0, n0 = _cpu(server), time.perf_counter(), psutil.cpu_times(), counter.value
        time.sleep(seconds)
        cpu, wall, busy1, calls = _cpu(server) - c0, time.perf_counter() - t0, psutil.cpu_times(), counter.value - n0
    finally:
        stop.set()
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
    idle = (busy1.idle - busy0.idle) / (wall * (os.cpu_count() or 1))
    return {"tasks": tasks, "calls_s": calls / wall, "server_cpu_pct": 100 * cpu / wall,
            "server_cpu_us_per_call": 1e6 * cpu / max(1, calls), "machine_busy_pct": 100 * (1 - idle),
            "task_cpu_pct": 100 * task_cpu}


# clusters of these many tasks in the steady state: the measured scaling runs' sizes, and two beyond them
LOAD_TASKS = (64, 128, 256, 512, 1024, 2048)


@contextlib.contextmanager
def hosted_store() -> Iterator[Tuple[int, psutil.Process]]:
    """A TCPStore hosted by a process of its own, as `towerflow launch` hosts it: (its port, its process), killed on
    leaving."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    host = subprocess.Popen([sys.executable, "-c", _HOST], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        yield int(host.stdout.readline()), psutil.Process(host.pid)
    finally:
        os.killpg(host.pid, signal.SIGKILL)
        host.wait(10)


def tcpstore(seconds: float, load: bool = False, task_cpu: float = 0.0) -> dict:
    from towerflow.cluster.store import c10d

    with hosted_store() as (port, server):
        client = c10d.connect_store("127.0.0.1", port, 60)
        out = calibrate(client, server, seconds)
        if load:
            out["under_load"] = []
            for tasks in LOAD_TASKS:
                row = under_load(port, server, tasks, 4 * seconds, task_cpu=task_cpu)
                out["under_load"].append(row)
                print(f"  {tasks} tasks, {row['calls_s']:,.0f} calls/s: server {row['server_cpu_pct']:.2f}% "
                      f"({row['server_cpu_us_per_call']:.1f} µs a call), machine busy {row['machine_busy_pct']:.0f}%",
                      flush=True)
        return out


def etcd(seconds: float) -> dict:
    from towerflow.cluster.ports import PortReservation
    from towerflow.cluster.store.etcd_store import EtcdStore

    held = PortReservation(2)
    client_port, peer_port = held.ports
    held.release()  # etcd binds them next
    data = Path(tempfile.mkdtemp(prefix="tf-etcd-cal-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    url, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    argv = ["etcd", "--name", "cal", "--data-dir", str(data / "m"), "--listen-client-urls", url,
            "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"cal={peer}", "--initial-cluster-state", "new", "--log-level", "warn"]
    proc = subprocess.Popen(argv, stdout=(data / "log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        store = EtcdStore([("127.0.0.1", client_port)], "calibration", timeout=30, reach_within=30)
        out = calibrate(store, psutil.Process(proc.pid), seconds)
        out["version"] = subprocess.run(["etcd", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        store.close()
        return out
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def summary(name: str, r: dict) -> str:
    fit = r["multi_get_server_cpu_us_fit"], r["check_server_cpu_us_fit"]
    return (f"{name}: server CPU µs per call: get {r['get']['server_cpu_us']:.1f}, set {r['set']['server_cpu_us']:.1f}, "
            f"add {r['add']['server_cpu_us']:.1f}; multi_get {fit[0]['per_call']:.1f} + {fit[0]['per_key']:.2f}/key, "
            f"check {fit[1]['per_call']:.1f} + {fit[1]['per_key']:.2f}/key | client wall µs: get {r['get']['wall_us']:.0f}, "
            f"add {r['add']['wall_us']:.0f} | a spaced add (the server's loop asleep): {r['add_spaced']['server_cpu_us']:.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per method")
    ap.add_argument("--etcd", action="store_true", help="calibrate /usr/bin/etcd too")
    ap.add_argument("--load", action="store_true", help="the embedded store's CPU per call under a cluster's calls")
    ap.add_argument("--task-cpu-pct", type=float, default=0.0,
                    help="with --load: what else each task spends of a core, %% (a scaling.py run's task_cpu_steady_pct)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"store_calibration_{time.strftime('%Y-%m-%d')}.json"))
    args = ap.parse_args(argv)
    out = {"meta": {"machine": f"{os.cpu_count()} cores, {psutil.cpu_freq().max if psutil.cpu_freq() else '?'} MHz",
                    "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_before": os.getloadavg(), "python": sys.version.split()[0]}}
    out["tcpstore"] = tcpstore(args.seconds, args.load, args.task_cpu_pct / 100)
    print(summary("TCPStore", out["tcpstore"]), flush=True)
    if args.etcd:
        if shutil.which("etcd") is None:
            print("etcd: not installed, skipped", flush=True)
        else:
            out["etcd"] = etcd(args.seconds)
            print(summary("etcd", out["etcd"]), flush=True)
    out["meta"]["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
