"""The processes of benchmarks/scaling.py: the rendezvous store's host, and a zygote that starts N light
tasks (each a `towerflow.Server` that joins, beats, watches its peers and leaves; no training).

    python benchmarks/_scaling_task.py store CONFIG    # hosts the store as `towerflow launch` does
    python benchmarks/_scaling_task.py tasks CONFIG    # imports torch once, then forks (or execs) N tasks
    python benchmarks/_scaling_task.py task CONFIG R   # one task (the exec mode)

Rank 0 is /job:ps/task:0, which does what a ps does (`server.join()`: the end barrier, which polls
every task); ranks 1.. are workers, which watch their peers as a worker waiting on a ps does
(`server.wait_watching(future, serving=("ps",))`) and, in the fan-in window, call the ps in a loop
(a small tensor, one call in flight each). The driver steers them through keys in the store
("bench/go/<phase>"), which each task waits on over a connection of its own (no polling, and the
Server's own store connection is never held by a waiting call). Results go back into the store
("bench/up/<rank>", "bench/end/<rank>"), which outlives the tasks.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import threading
import time
from collections import Counter

UP, STEADY, FANIN, WATCH = "up", "steady", "fanin", "watch"
BATCHED = ("check", "multi_get", "multi_set", "wait")  # methods whose first argument is a list of keys


def echo(x):
    """The ps side of a fan-in call (a Python function, as the ps's endpoints are)."""
    return x


class _CountedStore:
    """The Server's store with its calls, and the keys they name, counted per method (what this task asks of the
    store host: a multi_get of k keys is one call and k keys)."""

    def __init__(self, store):
        self._store, self.calls, self.keys, self.sites = store, Counter(), Counter(), Counter()

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            self.keys[name] += len(args[0]) if name in BATCHED and args else 1
            self.sites[f"{name} < {_callers()}"] += 1
            return attr(*args, **kwargs)

        return counted

    def by_method(self) -> dict:
        """{method: [calls, keys]} so far."""
        return {m: [self.calls[m], self.keys[m]] for m in self.calls}


def _callers(depth: int = 3) -> str:
    """The towerflow functions that made a store call, innermost first ("module.function < ...")."""
    out, f = [], sys._getframe(2)
    while f is not None and len(out) < depth:
        mod = f.f_globals.get("__name__", "")
        if mod.startswith("towerflow."):
            out.append(f"{mod.rsplit('.', 1)[-1]}.{f.f_code.co_name}")
        f = f.f_back
    return " < ".join(out) or "?"


def _timed(obj, name: str, into: dict) -> None:
    """Wrap obj.name (an instance attribute shadows the method) to record how long the call took."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.setdefault(name, []).append(time.perf_counter() - t)
            into.setdefault(f"{name}_cpu_end", []).append(_cpu())  # the process's CPU s when it returned

    setattr(obj, name, wrapper)


def _control(cfg: dict):
    from towerflow.cluster.store import c10d

    host, port = cfg["store"].rsplit(":", 1)
    # opened before the Server joins, and given long to answer: 128 of them opened at once, the moment the
    # cluster was up, did not all get an answer within connect_store's default 10 s on this 2-core machine
    return c10d.prefix_store("towerflow", c10d.connect_store(host, int(port), cfg["join_timeout"],
                                                                        answer_within=cfg["join_timeout"]))


def _cpu() -> float:
    """This process's CPU seconds, all threads (clock_gettime: not os.times' 10 ms ticks)."""
    return time.process_time()


def run_task(cfg: dict, rank: int) -> None:
    """One light task: join, report, then follow the driver's phases until a peer is lost."""
    t_start = time.time()
    os.environ.update(cfg["env"])
    import torch

    from towerflow.cluster.calls import endpoint
    from towerflow.cluster.server import Server
    from towerflow.errors import PeerLost

    torch.set_num_threads(1)
    if cfg.get("watch_from") is not None:  # force the direct check (a large number) or the group watch (0)
        from towerflow.cluster.membership import watch

        watch.WATCHED_FROM = cfg["watch_from"]
    job, index = ("ps", 0) if rank == 0 else ("worker", rank - 1)
    timings: dict = {}
    server = Server(cfg["cluster"], job, index, start=False)
    _timed(server.rendezvous, "meet", timings)
    _timed(server.rendezvous, "claim_slot", timings)  # the meet's own work ends here; then it waits for all slots
    joins = "join_calls" if hasattr(server.membership, "join_calls") else "join_rpc"  # this tree's, or an older one's
    _timed(server.membership, joins, timings)
    ctrl = _control(cfg)
    t_imported, cpu_imported = time.time(), _cpu()
    server.start()
    t_up = time.time()
    counted = _CountedStore(server.rendezvous.store)
    server.rendezvous.store = counted  # the membership reads the store through the rendezvous
    _timed(server.membership, "check_peers", timings)
    ctrl.set(f"bench/up/{rank}", json.dumps({
        "pid": os.getpid(), "start": t_start, "imported": t_imported, "up": t_up, "cpu_up": _cpu(),
        "cpu_imported": cpu_imported, "meet_s": timings["meet"][0], "join_rpc_s": timings[joins][0], "cpu_met": timings["meet_cpu_end"][0],
        "cpu_claimed": timings["claim_slot_cpu_end"][0], "cpu_joined": timings[f"{joins}_cpu_end"][0]}))
    marks: dict = {}  # phase -> (time, store calls so far, cpu seconds)
    by_method: dict = {}  # phase -> {method: [calls, keys]} so far
    sites: dict = {}  # phase -> {"method < caller < ...": calls} so far
    went = {p: threading.Event() for p in (STEADY, FANIN, WATCH)}

    def follow() -> None:  # the driver's phase changes, waited on in the store (no polling)
        for phase in (STEADY, FANIN, WATCH):
            ctrl.wait([f"bench/go/{phase}"], datetime.timedelta(seconds=cfg["run_timeout"]))
            marks[phase] = (time.time(), sum(counted.calls.values()), _cpu())
            by_method[phase] = counted.by_method()
            sites[phase] = dict(counted.sites)
            went[phase].set()

    marks[UP] = (time.time(), 0, _cpu())
    threading.Thread(target=follow, daemon=True).start()
    end = {"rank": rank, "calls_by_kind": {}, "lat": []}
    try:
        if job == "ps":
            server.join()  # what a ps does: the end barrier, watching every task until all are done
        else:
            ps = server.call_name_of("ps", 0)
            x = torch.zeros(cfg["fanin_floats"])
            server.wait_watching(_event_future(went[FANIN]), serving=("ps",))
            lat = end["lat"]
            while not went[WATCH].is_set():
                t = time.perf_counter()
                endpoint.call_async(ps, echo, args=(x,)).wait()
                lat.append(time.perf_counter() - t)
            server.wait_watching(torch.futures.Future(), serving=("ps",))  # until a peer is lost
    except PeerLost as e:
        end.update(detected=time.time(), lost=e.task, error=str(e)[:300])
    end.update(marks=marks, by_method=by_method, sites=sites, calls_by_kind=dict(counted.calls), cpu_end=_cpu(),
               checks=timings.get("check_peers", []), end=time.time())
    ctrl.set(f"bench/end/{rank}", json.dumps(end))
    # no leave, and no exit until the driver kills the run: hundreds of processes ending at once on a few cores
    # would delay the tasks that have not noticed the loss yet, and the benchmark would time the exits
    time.sleep(cfg["run_timeout"])
    os._exit(0)


def _event_future(event: threading.Event):
    """A torch future completed when `event` is set (so wait_watching returns at a phase change)."""
    import torch

    fut = torch.futures.Future()
    threading.Thread(target=lambda: (event.wait(), fut.set_result(None)), daemon=True).start()
    return fut


def host_store(cfg: dict) -> None:
    """Host the rendezvous store as the embedded launcher does (its own process, outliving every task)."""
    from towerflow.cluster.server import host_rendezvous

    store = host_rendezvous(cfg["cluster"], cfg["token"], cfg["store"], cfg["join_timeout"])
    print("ready", flush=True)
    while store is not None:
        time.sleep(3600)


def start_tasks(cfg: dict, config_path: str) -> None:
    """Start every task: forked from this process once torch is imported (`fork`: the tasks share
    torch's pages, so 128 fit in memory), or as fresh interpreters (`exec`: what a launch does)."""
    import subprocess

    if cfg["spawn"] == "exec":
        procs = [subprocess.Popen([sys.executable, __file__, "task", config_path, str(r)]) for r in range(cfg["tasks"])]
        for p in procs:
            p.wait()
        return
    import torch  # noqa: F401  (imported once, before forking)
    import towerflow.cluster.server  # noqa: F401

    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # keep the children from touching (and so copying) the parent's objects
    pids = []
    for rank in range(cfg["tasks"]):
        pid = os.fork()
        if pid == 0:
            try:
                run_task(cfg, rank)
            except BaseException as e:  # noqa: BLE001  (said, then the child ends)
                print(f"task {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def main(argv) -> None:
    what, config_path = argv[0], argv[1]
    with open(config_path) as f:
        cfg = json.load(f)
    if what == "store":
        host_store(cfg)
    elif what == "tasks":
        start_tasks(cfg, config_path)
    else:
        run_task(cfg, int(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
