"""How far do the rendezvous store, the heartbeats and the ps fan-in go? Starts clusters of N
light tasks on this machine (join, beat, watch, no training) and measures them. docs/scaling.md reads it.

    PYTHONPATH=src .venv/bin/python benchmarks/scaling.py --tasks 32 64 128 --repeats 2 \
        [--spawn fork|exec] [--heartbeat-timeout 5] [--steady 10] [--fanin 5] [--src new=src --src old=DIR]

Per run (benchmarks/_scaling_task.py has the processes): the store is hosted in a process of its own,
as `towerflow launch` hosts it; N tasks (ps:0 and N-1 workers, loopback addresses on free ports, the
launcher's token and TOWERFLOW_STORE) each create a `towerflow.Server`. Measured:
* join: from starting the tasks to each task's Server being up (its `meet` — store, slot, all slots — and
  its RPC join separately);
* steady (`--steady` s): the store calls every task makes (counted on the client side) plus the
  heartbeats (the counters' growth, read in the store: under 1 beat/s per task means CPU starvation),
  each task's and the store host's CPU, the machine's, a side client's get latency, memory (RSS, USS);
* fan-in (`--fanin` s): every worker calls the ps in a loop (one 1 KB call in flight each): calls/s, latency;
* detection: the last worker is SIGKILLed; how long until each other task raises PeerLost.
Every task counts its store calls and the keys they name per method (get, multi_get, check, add, ...), from its
Server being up to the driver's steady mark (the rest of the join), and over the steady window; the run JSON
keeps them per task (`store_by_task`) and summed (`store_by_method`).
`--watch direct|group` forces the direct peer check or the group watch (watch.py) whatever the size.
With `--src NAME=DIR` twice, the tasks run each source tree in turn (old and new code interleaved). The repeats go
round the sizes (every size once, then again), so that a size run first is not a calibration made at another
speed of the machine than the sizes run after it.
Every process is killed at the end (process groups); every wait has a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scaling_report import detections, print_methods, print_table, store_by_method, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASK = Path(__file__).resolve().parent / "_scaling_task.py"
MB = 1 << 20
PILOT = 8  # tasks of the run that measures memory per task first


def _env(src: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TOWERFLOW_", "TF_CONFIG", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONPATH=src, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _cpu(procs: List[psutil.Process]) -> List[Optional[float]]:
    out = []
    for p in procs:
        try:
            t = p.cpu_times()
            out.append(t.user + t.system)
        except psutil.Error:
            out.append(None)
    return out


def _wait(what: str, condition, deadline: float, every: float = 0.2):
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(every)


def _latencies(store, seconds: float, key: str = "coordinator") -> List[float]:
    """A side client's get round trips against the store, for `seconds` (one every 20 ms)."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        store.get(key)
        out.append(time.perf_counter() - t)
        time.sleep(0.02)
    return out


def one_run(n: int, src: str, args, tmp: Path, watch: str = "auto") -> dict:
    from towerflow.cluster.store import c10d
    from towerflow.cluster.ports import LOOPBACK, PortReservation

    held = PortReservation(n + 1)  # closed when this run returns
    ports = held.ports
    addr = [f"{LOOPBACK}:{p}" for p in ports]
    cfg = {"tasks": n, "spawn": args.spawn, "store": addr[0], "token": os.urandom(8).hex(),
           "cluster": {"ps": [addr[1]], "worker": addr[2:]}, "join_timeout": args.run_timeout,
           "run_timeout": args.run_timeout, "fanin_floats": 256,
           "watch_from": {"auto": None, "direct": 1 << 30, "group": 0}[watch]}
    cfg["env"] = {"TOWERFLOW_STORE": cfg["store"], "TOWERFLOW_CLUSTER_TOKEN": cfg["token"],
                  "TOWERFLOW_JOIN_TIMEOUT": str(args.run_timeout),
                  "TOWERFLOW_HEARTBEAT_TIMEOUT": str(args.heartbeat_timeout), "OMP_NUM_THREADS": "1"}
    path = tmp / f"cfg-{n}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(cfg))
    deadline = time.monotonic() + args.run_timeout
    started: List[subprocess.Popen] = []
    out: dict = {"tasks": n, "src": src, "spawn": args.spawn, "heartbeat_timeout": args.heartbeat_timeout,
                 "load_before": os.getloadavg()}
    try:
        host = subprocess.Popen([sys.executable, str(TASK), "store", str(path)], env=_env(src), stdout=subprocess.PIPE,
                                stderr=(tmp / "store.err").open("wb"), start_new_session=True, text=True)
        started.append(host)
        if host.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the store host did not start: {(tmp / 'store.err').read_text()[-2000:]}")
        host_ps = psutil.Process(host.pid)
        client = c10d.prefix_store("towerflow", c10d.connect_store(LOOPBACK, ports[0], args.run_timeout))
        out["probe_idle"] = _latencies(client, 1.0)
        host_cpu0 = _cpu([host_ps])[0]
        t0 = time.time()
        tasks = subprocess.Popen([sys.executable, str(TASK), "tasks", str(path)], env=_env(src),
                                 stdout=(tmp / "tasks.out").open("wb"), stderr=(tmp / "tasks.err").open("wb"),
                                 start_new_session=True)
        started.append(tasks)
        up_keys = [f"bench/up/{r}" for r in range(n)]

        def all_up():
            if tasks.poll() is not None:
                raise RuntimeError(f"the tasks exited early: {(tmp / 'tasks.err').read_text()[-3000:]}")
            return client.check(up_keys)

        try:
            _wait(f"{n} tasks up", all_up, deadline)
        except TimeoutError as e:
            raise TimeoutError(f"{e}: {_join_state(client, cfg['cluster'])}") from None
        t_all_up = time.time()
        out["host_cpu_join"] = (_cpu([host_ps])[0] - host_cpu0) / (t_all_up - t0)
        ups = [json.loads(v) for v in client.multi_get(up_keys)]
        out.update(t0=t0, ups=ups, all_up_s=max(u["up"] for u in ups) - t0)
        procs = [psutil.Process(u["pid"]) for u in ups]
        beat_keys = ["beat/ps/0"] + [f"beat/worker/{i}" for i in range(n - 1)]
        # steady: every task beating and watching
        client.set("bench/go/steady", "1")  # the tasks' steady window starts here, after every task is up
        c0, h0, m0, b0, s0 = _cpu(procs), _cpu([host_ps])[0], psutil.cpu_times(), client.multi_get(beat_keys), time.time()
        out["probe_steady"] = _latencies(client, args.steady)
        c1, h1, m1, b1, s1 = _cpu(procs), _cpu([host_ps])[0], psutil.cpu_times(), client.multi_get(beat_keys), time.time()
        dt = s1 - s0
        out["beats_per_task_s"] = [(int(b) - int(a)) / dt for a, b in zip(b0, b1)]
        out["task_cpu_s"] = [(b - a) / dt for a, b in zip(c0, c1) if a is not None and b is not None]
        out["host_cpu_steady"] = (h1 - h0) / dt
        busy = lambda t: t.user + t.system + t.nice + t.irq + t.softirq  # noqa: E731
        out["machine_busy"] = (busy(m1) - busy(m0)) / dt / psutil.cpu_count()
        out["load_steady"] = os.getloadavg()
        mem = []
        for p in procs:
            try:
                mi = p.memory_full_info()
                mem.append((mi.rss, mi.uss))
            except psutil.Error:
                pass
        out["rss"], out["uss"] = [m[0] for m in mem], [m[1] for m in mem]
        out["host_rss"] = host_ps.memory_info().rss
        # fan-in: every worker calls the ps
        ps_cpu0, f0 = _cpu(procs[:1])[0], time.time()
        client.set("bench/go/fanin", "1")
        time.sleep(args.fanin)
        out["ps_cpu_fanin"] = (_cpu(procs[:1])[0] - ps_cpu0) / (time.time() - f0)
        client.set("bench/go/watch", "1")
        time.sleep(2.0)  # the watchers begin a new wait (their `seen` starts afresh)
        victim = procs[-1]
        t_kill = time.time()
        victim.send_signal(signal.SIGKILL)
        out["t_kill"] = t_kill
        end_keys = [f"bench/end/{r}" for r in range(n - 1)]
        try:
            _wait("every survivor to notice the loss", lambda: client.check(end_keys),
                  min(deadline, time.monotonic() + args.heartbeat_timeout + 120))
        except TimeoutError as e:
            out["detect_timeout"] = str(e)
        ends = []
        for k in end_keys:
            if client.check([k]):
                ends.append(json.loads(client.get(k)))
        out["ends"] = ends
        out["load_after"] = os.getloadavg()
        return out
    finally:
        for p in started:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                print(f"process group {p.pid} did not end", file=sys.stderr)


def store_costs(keys: int = 2000, rounds: int = 20) -> Dict[str, float]:
    """What one TCPStore call and one key of a batched call cost, on a store served from this process
    (µs of wall time per call and per key: the figure the extrapolation to 1,000 hosts uses)."""
    from towerflow.cluster.store import c10d
    from towerflow.launch.local import LOOPBACK

    host = c10d.host_store(c10d.listen(LOOPBACK, 0), 30)
    client = c10d.connect_store(LOOPBACK, host.port, 30)
    names = [f"beat/worker/{i}" for i in range(keys)]
    for k in names:
        client.add(k, 1)

    def per(fn, n: int) -> float:
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e6 * statistics.median(times) / n

    return {"get_us_per_call": per(lambda: [client.get(k) for k in names[:200]], 200),
            "add_us_per_call": per(lambda: [client.add(k, 0) for k in names[:200]], 200),
            "multi_get_us_per_key": per(lambda: client.multi_get(names), keys),
            "check_us_per_key": per(lambda: client.check(names), keys), "keys": keys}


def _join_state(client, cluster: dict) -> str:
    """Where a join that timed out stands: how many tasks hold their slot, are up, and who holds torch's RPC join token."""
    tasks = [(job, i) for job, addrs in cluster.items() for i in range(len(addrs))]
    counts = {kind: sum(client.check([f"{kind}/{job}/{i}"]) for job, i in tasks) for kind in ("slot", "up")}
    token_key = "rpc/RpcGroupManagementToken"
    token = client.get(token_key).decode() if client.check([token_key]) else None
    members = client.get("rpc/names/_ALL_WORKER_INFOS").decode().count(",") if client.check(["rpc/names/_ALL_WORKER_INFOS"]) else 0
    return f"{counts['slot']} slots held, {counts['up']} up, {members} RPC members, RPC join token held by {token!r}"


def _estimate_mb(runs: List[dict], spawn: str) -> float:
    """Memory per task for the guard: the largest USS seen so far, else this process's (torch imported)."""
    seen = [max(r["uss"]) for r in runs if r.get("uss") and r["spawn"] == spawn]
    if seen:
        return max(seen) / MB
    import torch  # noqa: F401

    return psutil.Process().memory_full_info().uss / MB


def resolver_probe(lookups: int = 128) -> float:
    """The slowest of `lookups` simultaneous reverse lookups of ::ffff:127.0.0.1, the address a TCPStore client
    looks its own name up by on loopback: seconds of a resolver's timeout each connection of a join storm waits
    (docs/cluster.md), which a run's join times then carry besides the protocol."""
    import socket
    import threading

    took: List[float] = []

    def lookup() -> None:
        t = time.perf_counter()
        try:
            socket.getnameinfo(("::ffff:127.0.0.1", 1, 0, 0), 0)
        except OSError:
            pass
        took.append(time.perf_counter() - t)

    threads = [threading.Thread(target=lookup, daemon=True) for _ in range(lookups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return max(took, default=30.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--spawn", choices=("fork", "exec"), default="fork")
    ap.add_argument("--heartbeat-timeout", "--heartbeat_timeout", type=float, default=5.0)
    ap.add_argument("--steady", type=float, default=10.0)
    ap.add_argument("--fanin", type=float, default=5.0)
    ap.add_argument("--run-timeout", "--run_timeout", type=float, default=300.0)
    ap.add_argument("--watch", choices=("auto", "direct", "group"), nargs="+", default=["auto"],
                    help="how tasks check their peers: as the code decides by size, or forced (several: interleaved)")
    ap.add_argument("--src", action="append", default=[], help="NAME=DIR: the source tree the tasks import")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scaling.json"))
    ap.add_argument("--raw", action="store_true", help="keep every task's own records (its up and its end) in the JSON")
    args = ap.parse_args(argv)
    srcs = dict(s.split("=", 1) for s in args.src) or {"new": str(ROOT / "src")}
    srcs = {k: str(Path(v).resolve()) for k, v in srcs.items()}
    resolver_s = resolver_probe()
    if resolver_s > 0.5:
        print(f"note: 128 simultaneous reverse lookups of ::ffff:127.0.0.1 took up to {resolver_s:.1f} s here: every join "
              "below includes the name resolver's timeouts (docs/cluster.md: list the address in /etc/hosts)", flush=True)
    costs = store_costs()
    print("store costs (this process's own store, µs): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()), flush=True)
    runs: List[dict] = []
    refused: List[str] = []
    failed: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="tf-scaling-") as tmp:
        tasks = sorted(args.tasks)
        if tasks[0] > PILOT:  # memory per task is measured on a small cluster before a large one is started
            tasks.insert(0, PILOT)
        # the repeats go round the sizes, so that a drift in the machine's speed (minutes long on a shared host)
        # falls on every size alike, a calibration size included
        order = [(rep, n) for rep in range(args.repeats) for n in tasks
                 if rep == 0 or n != PILOT or n in args.tasks]
        refused_sizes = set()
        for rep, n in order:
            if n in refused_sizes:
                continue
            need = n * _estimate_mb(runs, args.spawn) * 1.3 + 512
            avail = psutil.virtual_memory().available / MB
            if need > avail:
                msg = (f"refused {n} tasks: they would need about {need:.0f} MB ({_estimate_mb(runs, args.spawn):.0f} MB "
                       f"per task measured, +30%) and {avail:.0f} MB are available; use --spawn fork or fewer --tasks")
                print(msg, flush=True)
                refused.append(msg)
                refused_sizes.add(n)
                continue
            for (name, src), watch in [(s, w) for s in srcs.items() for w in args.watch]:
                name = name if watch == "auto" else f"{name}/{watch}"
                where = Path(tmp) / f"{name.replace('/', '-')}-{n}-{rep}"
                where.mkdir()
                try:
                    r = one_run(n, src, args, where, watch)
                except Exception as e:  # noqa: BLE001  (recorded with the tasks' last words; the next run goes on)
                    err = (where / "tasks.err").read_text(errors="replace") if (where / "tasks.err").exists() else ""
                    err = "\n".join(line for line in err.splitlines() if "waiting for" not in line)[-3000:]
                    failed.append({"variant": name, "tasks": n, "repeat": rep, "error": f"{type(e).__name__}: {e}",
                                   "tasks_stderr": err, "load": os.getloadavg()})
                    print(f"{name} N={n} repeat {rep} FAILED: {e}\n{err}", flush=True)
                    continue
                r.update(variant=name, repeat=rep)
                runs.append(r)
                s = summarize(r)
                print(f"{name} N={n} repeat {rep}: " + ", ".join(f"{k} {v}" for k, v in s.items()), flush=True)
                print_methods(r)
    rows = print_table(runs)
    meta = {"machine": f"{os.cpu_count()} cores, {psutil.virtual_memory().total / (1 << 30):.0f} GiB",
            "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "python": sys.version.split()[0], "refused": refused, "failed": failed, "store_costs": costs, "sources": srcs,
            "resolver_lookup_max_s": resolver_s}
    dropped = ("probe_idle", "probe_steady") if args.raw else ("ups", "ends", "probe_idle", "probe_steady")
    slim = [{k: v for k, v in r.items() if k not in dropped} | summarize(r)
            | store_by_method(r) | {"detections": detections(r)} for r in runs]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "table": rows, "runs": slim}, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
