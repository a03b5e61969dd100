"""A model of towerflow's cluster protocol against its rendezvous store: the store work of the heartbeats and the
peer checks (the direct check and the group watch, cluster/membership/), the join, and how long a loss takes to
be noticed. benchmarks/scaling_sim.py checks it against the measured runs and extrapolates; docs/scaling.md reads it.

Every rate below is read off the code (the caller of each store call is named); the store's costs come from
benchmarks/store_calibration.py. Times in seconds, CPU in seconds of one core per second, costs in µs.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Dict, List, Tuple

BEAT_EVERY = 1.0  # rendezvous.BEAT_EVERY: one `add` per task per second (membership._start_heartbeat)
CHECK_EVERY = 1.0  # a worker's peer check while it waits (membership.wait_watching)
BARRIER_EVERY = 0.2  # a task in the end barrier (membership.wait_until_all_done: 2 * POLL)
WATCH_EVERY = 0.5  # watch.WATCH_EVERY: a task's tick (its group, or its watcher)
WATCHED_FROM = 32  # watch.WATCHED_FROM: larger clusters are watched by group
POLL = 0.1  # rendezvous.POLL: a wait for all slots / all up
CHECK_WINDOW = 64  # rendezvous.CHECK_WINDOW: the keys a poll asks about at first

Load = Dict[str, Tuple[float, float]]  # method -> (calls/s, keys/s)


@dataclass(frozen=True)
class StoreCosts:
    """What the store spends per call and per key (server CPU µs), and a call's round trip seen by a client (µs)."""

    cpu_call: Dict[str, float]
    cpu_key: Dict[str, float]
    round_trip: float
    cores: float = 1.0  # the cores its server can use (TCPStore: one event loop)
    wake: float = 0.0  # µs more for a call that finds the server's loop asleep (calls spaced apart)

    def cpu(self, load: Load) -> float:
        """Seconds of server CPU per second for `load`, calls back to back (the lower bound)."""
        return sum(1e-6 * (c * self.cpu_call.get(m, self.cpu_call["add"]) + k * self.cpu_key.get(m, 0.0))
                   for m, (c, k) in load.items())

    def cpu_range(self, load: Load) -> Tuple[float, float]:
        """(back to back, every call waking the loop): a cluster's calls arrive a few at a time, and how many share
        a wake-up depends on how busy the machine's cores are, so the store's CPU lies between the two."""
        low = self.cpu(load)
        return low, low + 1e-6 * self.wake * total(load)[0]

    @classmethod
    def from_calibration(cls, r: dict, cores: float = 1.0) -> "StoreCosts":
        """From one store's section of store_calibration.py's JSON (`set` is costed as `add`: TCPStore's set
        is pipelined, so its single-client figure says little)."""
        call = {m: r[m]["server_cpu_us"] for m in ("get", "add")}
        call["set"] = call["compare_set"] = call["add"]
        key = {}
        for m in ("check", "multi_get"):
            fit = r[f"{m}_server_cpu_us_fit"]
            call[m], key[m] = fit["per_call"], fit["per_key"]
        wake = max(0.0, r["add_spaced"]["server_cpu_us"] - call["add"]) if "add_spaced" in r else 0.0
        return cls(call, key, r["add"]["wall_us"], cores, wake)


def _plus(load: Load, method: str, calls: float, keys_per_call: float = 1.0) -> None:
    c, k = load.get(method, (0.0, 0.0))
    load[method] = (c + calls, k + calls * keys_per_call)


def uses_group_watch(n: int) -> bool:
    return n > WATCHED_FROM


def group_size(n: int) -> int:
    return max(1, math.ceil(math.sqrt(n)))


def steady_load(n: int, ps: int = 1, group: bool = None, barrier_ps: bool = True, batched_tick: bool = True) -> Load:
    """The cluster's store calls and keys per second once every task is up: N beats; each worker's peer check
    (`check_peers`) once a second; each ps in the end barrier (`wait_until_all_done`) five times a second (a ps
    calls `join()` as soon as it serves); with the group watch, every task's tick twice a second.
    `group`: None as the code decides by size (above WATCHED_FROM tasks)."""
    group = uses_group_watch(n) if group is None else group
    workers, barrier = n - ps, (ps if barrier_ps else 0)
    load: Load = {}
    _plus(load, "add", n / BEAT_EVERY)
    checks, polls = workers / CHECK_EVERY, barrier / BARRIER_EVERY
    if not group:
        # ending.done_version, failures.any_recorded, then membership.beats_of: check + multi_get of every other
        # task's beat and incarnation (2 keys each)
        for rate in (checks, polls):
            _plus(load, "add", 2 * rate)
            _plus(load, "check", rate, 2 * (n - 1))
            _plus(load, "multi_get", rate, 2 * (n - 1))
        return load
    # the verdicts: done_version, any_recorded, and watch._refresh's lost/version (watch.lost_among)
    _plus(load, "add", 3 * (checks + polls))
    # watch.tick: lost/version and the beats of its targets (the watcher: the group's other members; a member:
    # its watcher) in one multi_get once a check found the keys (`batched_tick`), else an add, a check and a multi_get
    g = group_size(n)
    groups = math.ceil(n / g)
    watcher_keys, member_keys = 2 * (g - 1), 2
    watchers, members = groups, n - groups
    if batched_tick:
        for count, keys in ((watchers, watcher_keys), (members, member_keys)):
            _plus(load, "multi_get", count / WATCH_EVERY, 1 + keys)
        return load
    _plus(load, "add", n / WATCH_EVERY)
    for count, keys in ((watchers, watcher_keys), (members, member_keys)):
        _plus(load, "check", count / WATCH_EVERY, keys)
        _plus(load, "multi_get", count / WATCH_EVERY, keys)
    return load


def done_reread(n: int, readers: int, changes: int, batched: bool) -> Load:
    """The store work of `changes` changes to the done set read by `readers` tasks: before the change log, two
    one-key checks per task per change (membership._marked); with it, a check and a multi_get of the new records
    (ending.changes)."""
    load: Load = {}
    if batched:
        _plus(load, "check", readers * changes, 1)
        _plus(load, "multi_get", readers * changes, 1)
    else:
        _plus(load, "check", readers * changes * 2 * n, 1)
    return load


def total(load: Load) -> Tuple[float, float]:
    """(calls/s, keys/s)."""
    return sum(c for c, _ in load.values()), sum(k for _, k in load.values())


def scaled(load: Load, by: float) -> Load:
    return {m: (c * by, k * by) for m, (c, k) in load.items()}


def merged(*loads: Load) -> Load:
    out: Load = {}
    for load in loads:
        for m, (c, k) in load.items():
            _plus(out, m, c, k / c if c else 0.0)
    return out


def wait_in_queue(utilization: float, service_s: float) -> float:
    """A call's mean wait at a store busy `utilization` of the time (M/M/1: ρ/(1-ρ) services); inf at saturation."""
    if utilization >= 1.0:
        return math.inf
    return service_s * utilization / (1.0 - utilization)


def store_latency(load: Load, costs: StoreCosts) -> Tuple[float, float]:
    """(utilization of the store's cores, a call's round trip in s including its wait)."""
    util = costs.cpu(load) / costs.cores
    calls = max(1.0, total(load)[0])
    service = costs.cpu(load) / calls
    return util, 1e-6 * costs.round_trip + wait_in_queue(util, service)


def detection(n: int, timeout: float, latency: float, group: bool = None, trials: int = 400,
              seed: int = 0) -> Dict[str, float]:
    """When the survivors notice a SIGKILLed worker (s after the kill): a discrete-event draw of the phases.

    The victim beat last `a` ~ U(0, 1) s before the kill. A reader (every `every` s, its own phase) first sees
    the last count at its first read after that beat and takes the task for lost at the first read more than
    `timeout` later. Direct: each worker reads every CHECK_EVERY s, and the ps in its end barrier every
    BARRIER_EVERY s; the ps records its failure as it notices, and a worker that has not noticed yet reads that
    record at its next check. Group: the victim's watcher reads every WATCH_EVERY s and publishes; each survivor's
    next tick reads the publication and wakes its wait. Each store read adds `latency`. inf when latency ≥
    timeout (beats read too late: healthy tasks would be taken for lost)."""
    if latency >= timeout:
        return {"first": math.inf, "med": math.inf, "max": math.inf}
    group = uses_group_watch(n) if group is None else group
    rng, out = random.Random(seed), []

    def noticed_by(last_beat: float, every: float, phase: float) -> float:
        first_seen = last_beat + phase + latency  # the first read after the last beat
        # reads come a little over `every` apart (the wait, then the read itself), so the ceil(timeout /
        # every)-th one after the first is already past the timeout
        return first_seen + math.ceil(timeout / every) * every

    for _ in range(trials):
        last_beat = -rng.uniform(0, BEAT_EVERY)
        if group:
            published = noticed_by(last_beat, WATCH_EVERY, rng.uniform(0, WATCH_EVERY))
            out.append(published + rng.uniform(0, WATCH_EVERY) + latency)
            continue
        phase = rng.uniform(0, CHECK_EVERY)
        own = noticed_by(last_beat, CHECK_EVERY, phase)
        by_ps = noticed_by(last_beat, BARRIER_EVERY, rng.uniform(0, BARRIER_EVERY)) + 2 * latency  # recorded
        next_check = phase + math.ceil((by_ps - phase) / CHECK_EVERY) * CHECK_EVERY + latency
        out.append(min(own, next_check))
    out.sort()
    return {"first": out[0], "med": statistics.median(out), "max": out[-1]}


@dataclass(frozen=True)
class Host:
    """The cores the tasks share, and what a task spends of them (measured at a size where nothing waits for a
    core). The measured runs put every task on one machine; a real cluster one task per host (no Host: the
    protocol alone)."""

    cores: float
    tasks: int  # how many of the cluster's tasks share these cores
    task_cpu: float  # a task's CPU s per s once up (its beats, ticks and checks, and their threads)
    post_meet_cpu: float  # a task's CPU s from the end of its meet (every slot taken) until it is up
    client_check_cpu: Tuple[float, float] = (0.0, 0.0)  # a client's CPU s per check call, and per key of it

    def free_cores(self, busy_tasks: float, polls_s: float, keys_per_poll: float, store_cpu: float) -> float:
        """The cores left once the up tasks' steady work, the waiting tasks' polls and the store are served."""
        call, key = self.client_check_cpu
        return self.cores - busy_tasks * self.task_cpu - polls_s * (call + key * keys_per_poll) - store_cpu


def join_after_last_start(n: int, latency: float, round_trips: int = 12, host: "Host" = None,
                          store_cpu: float = 0.0) -> float:
    """From the last task's start (torch imported) until every task is up: the last task's own round trips (store,
    publisher, slot, its endpoint's address, first beat, incarnation, up: `round_trips`), and two waits for all
    (slots, then up) that each see the last key at most one POLL late. On a shared `host`, every task's work from
    its meet's end to up (`post_meet_cpu`) starts at once when the last slot is taken, and shares the cores left
    by the tasks' steady work, the polls of those already up (half the cluster on average, each asking for the
    other half ten times a second) and the store (`store_cpu`)."""
    protocol = round_trips * latency + 2 * POLL
    if host is None:
        return protocol
    on_host = min(n, host.tasks)
    free = host.free_cores(on_host, (on_host / 2) / POLL, n / 2, store_cpu)
    if free <= 0:
        return math.inf
    return protocol + on_host * host.post_meet_cpu / free


def join_poll_load(n: int, missing: int, window: int = CHECK_WINDOW) -> Load:
    """The store work of the N - `missing` tasks already waiting for all while `missing` keys are unset
    (rendezvous.unmarked): a check of the first `window` missing keys (None: all of them), then one-key checks up
    to the first unset, ten times a second each. Largest at missing = N/2."""
    load: Load = {}
    waiting = n - missing
    if missing <= 0 or waiting <= 0:
        return load
    _plus(load, "check", waiting / POLL, missing if window is None else min(missing, window))
    # the walk stops at the first unset key: in random arrival order, N / missing keys in
    _plus(load, "check", waiting / POLL * n / missing, 1)
    return load


def fanin_latency(workers: int, ps_calls_per_s: float) -> float:
    """A worker's small call to one ps, every worker one in flight: W / X (closed loop at the ps's capacity)."""
    return workers / ps_calls_per_s


def predict(n: int, ps: int, costs: StoreCosts, timeout: float = 5.0, group: bool = None) -> dict:
    """The steady store load, its utilization and latency, the detection time and the join's protocol time."""
    load = steady_load(n, ps, group)
    util, latency = store_latency(load, costs)
    calls, keys = total(load)
    join_load = merged(load, join_poll_load(n, n // 2))  # half the cluster still missing: the storm's peak
    join_util, join_latency = store_latency(join_load, costs)
    return {"tasks": n, "ps": ps, "group_watch": uses_group_watch(n) if group is None else group,
            "store_calls_s": calls, "store_keys_s": keys, "store_cpu_s": costs.cpu_range(load), "store_util": util,
            "call_latency_s": latency, "join_peak_util": join_util,
            "join_after_last_start_s": join_after_last_start(n, join_latency),
            "detect": detection(n, timeout, latency, group)}


def break_point(costs: StoreCosts, group: bool = None, ps_per: int = 100, lo: int = 8, hi: int = 10 ** 6) -> int:
    """The smallest N (one ps per `ps_per` tasks) whose steady load saturates the store."""
    def saturated(n: int) -> bool:
        return store_latency(steady_load(n, max(1, n // ps_per), group), costs)[0] >= 1.0

    if not saturated(hi):
        return hi
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if saturated(mid) else (mid, hi)
    return hi


def rows(sizes: List[int], ps_per: int, costs: StoreCosts, timeout: float = 5.0) -> List[dict]:
    return [predict(n, max(1, n // ps_per), costs, timeout) for n in sizes]
