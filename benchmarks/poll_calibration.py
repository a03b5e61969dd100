"""What a task waiting for all (slots, or all up) spends of this machine's cores per poll, when K tasks poll at
once: the figure benchmarks/_scaling_model.py's join on a shared host runs on.

    PYTHONPATH=src .venv/bin/python benchmarks/poll_calibration.py [--tasks 8 64 256 512] [--seconds 4] [--out FILE]

A TCPStore is hosted by a process of its own, as `towerflow launch` hosts it; K processes forked from one that
imported torch (as benchmarks/scaling.py starts its tasks) each connect to it and poll ten times a second with the
rendezvous' own `unmarked` (one call about a window of the K tasks' keys, none of them set: a poll while
tasks are still missing) for `--seconds`. Each reports its CPU per poll (all its threads) and how late its
polls came (a poll due every 0.1 s that waits for a core comes late). Past a few dozen processes on two cores a
poll costs more than alone: the processes' caches and the scheduler's switches are shared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import namedtuple
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_calibration import hosted_store  # noqa: E402

Task = namedtuple("Task", "job task")


def _poller(port: int, tasks: int, seconds: float, ready, go, out) -> None:
    """One waiting task: the rendezvous' `unmarked` over `tasks` unset keys, every POLL s, for `seconds`."""
    from towerflow.cluster.membership import rendezvous
    from towerflow.cluster.store import c10d

    class Waiting:  # the rendezvous' own poll, on a store of its own
        key, is_marked, unmarked = rendezvous.Rendezvous.key, rendezvous.Rendezvous.is_marked, rendezvous.Rendezvous.unmarked

        def __init__(self, store):
            self.store, self.job, self.index = store, "worker", 0

    waiting = Waiting(c10d.prefix_store("towerflow", c10d.connect_store("127.0.0.1", port, 120)))
    missing = [Task("worker", i) for i in range(tasks)]
    ready.wait()
    go.wait()
    polls, late, cpu0, t0 = 0, [], time.process_time(), time.monotonic()
    due = t0
    while time.monotonic() - t0 < seconds:
        late.append(max(0.0, time.monotonic() - due))
        waiting.unmarked("up", missing)
        polls += 1
        due = time.monotonic() + rendezvous.POLL
        time.sleep(rendezvous.POLL)
    out.put({"polls": polls, "cpu_s": time.process_time() - cpu0, "late_med_s": statistics.median(late)})


def calibrate(port: int, k: int, seconds: float) -> dict:
    ctx = mp.get_context("fork")
    ready, go, out = ctx.Barrier(k + 1), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_poller, args=(port, k, seconds, ready, go, out)) for _ in range(k)]
    for p in procs:
        p.start()
    try:
        ready.wait(300)
        busy0, t0 = psutil.cpu_times(), time.perf_counter()
        go.set()
        rows = [out.get(timeout=seconds + 120) for _ in procs]
        busy1, wall = psutil.cpu_times(), time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    idle = (busy1.idle - busy0.idle) / (wall * (os.cpu_count() or 1))
    per_poll = [r["cpu_s"] / r["polls"] for r in rows if r["polls"]]
    return {"tasks": k, "poll_cpu_us_med": 1e6 * statistics.median(per_poll),
            "polls_s": sum(r["polls"] for r in rows) / seconds, "late_med_s": statistics.median(r["late_med_s"] for r in rows),
            "machine_busy_pct": 100 * (1 - idle)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, nargs="+", default=[8, 64, 256, 512])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"poll_calibration_{time.strftime('%Y-%m-%d')}.json"))
    args = ap.parse_args(argv)
    import torch  # noqa: F401  (the pollers are forked from a process that imported it, as the scaling runs' tasks)

    rows = []
    with hosted_store() as (port, _server):
        for k in args.tasks:
            row = calibrate(port, k, args.seconds)
            rows.append(row)
            print(f"{k} tasks polling: {row['poll_cpu_us_med']:.0f} µs of CPU a poll (median task), "
                  f"{row['polls_s']:,.0f} polls/s, polls {1e3 * row['late_med_s']:.1f} ms late, "
                  f"machine busy {row['machine_busy_pct']:.0f}%", flush=True)
    meta = {"machine": f"{os.cpu_count()} cores", "command": " ".join(sys.argv), "python": sys.version.split()[0],
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
