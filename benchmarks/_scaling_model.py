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
from typing import Dict, List, Optional, Tuple

BEAT_EVERY = 1.0  # rendezvous.BEAT_EVERY: one `add` per task per second (membership._start_heartbeat)
CHECK_EVERY = 1.0  # a worker's peer check while it waits (membership.wait_watching)
BARRIER_EVERY = 0.2  # a task in the end barrier (membership.wait_until_all_done: 2 * POLL)
WATCH_EVERY = 0.5  # watch.WATCH_EVERY: a task's tick (its group, or its watcher)
WATCHED_FROM = 32  # watch.WATCHED_FROM: larger clusters are watched by group
POLL = 0.1  # rendezvous.POLL: a wait for all slots / all up
JOIN_ROUND_TRIPS = 12  # a task's store calls from its meet to up (publisher, slot, endpoint address, first beat, ...)
CHECK_WINDOW = 64  # rendezvous.CHECK_WINDOW: the keys a poll asks about at first

Load = Dict[str, Tuple[float, float]]  # method -> (calls/s, keys/s)
# one task of store_calibration.py's load (its TASK_CALLS): a beat and a check's three adds, two ticks' multi_gets
# of three keys, per second
CALIBRATION_MIX: Load = {"add": (4.0, 4.0), "multi_get": (2.0, 6.0)}


def log_interpolated(points, x: float) -> float:
    """The figure at `x` of calibrated (x, figure) `points`: interpolated in log(x) between them, the nearest point's
    figure outside them."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1]


@dataclass(frozen=True)
class StoreCosts:
    """What the store spends per call and per key (server CPU µs), and a call's round trip seen by a client (µs)."""

    cpu_call: Dict[str, float]
    cpu_key: Dict[str, float]
    round_trip: float
    cores: float = 1.0  # the cores its server can use (TCPStore: one event loop)
    wake: float = 0.0  # µs more for a call that finds the server's loop asleep (calls spaced apart)
    # (calls/s, server CPU µs per call) with a cluster's mix of calls arriving from many connections, by rate
    under_load: Tuple[Tuple[float, float], ...] = ()

    def cpu(self, load: Load) -> float:
        """Seconds of server CPU per second for `load`, calls back to back (the lower bound)."""
        return sum(1e-6 * (c * self.cpu_call.get(m, self.cpu_call["add"]) + k * self.cpu_key.get(m, 0.0))
                   for m, (c, k) in load.items())

    def cpu_range(self, load: Load) -> Tuple[float, float]:
        """(back to back, every call waking the loop): a cluster's calls arrive a few at a time, and how many share
        a wake-up depends on how busy the machine's cores are, so the store's CPU lies between the two."""
        low = self.cpu(load)
        return low, low + 1e-6 * self.wake * total(load)[0]

    def per_call_at(self, rate: float) -> Optional[float]:
        """The server's CPU µs per call when a cluster's calls arrive at `rate` per s (None: not calibrated):
        interpolated in log(rate) between the calibrated rates; below them the slowest rate's figure, above them
        the fastest's (more calls share a wake-up as the rate grows, so past the calibration this is an upper
        bound, and `cpu` the lower)."""
        if not self.under_load or rate <= 0:
            return None
        return log_interpolated(self.under_load, rate)

    def cpu_loaded(self, load: Load) -> Tuple[float, float]:
        """The store's CPU (s per s) for `load` at its rate of calls, as the calibration under load measured it:
        its back-to-back cost (`cpu`) plus, per call, what a call of the calibration's mix cost there beyond its
        own back-to-back cost (the wake-ups its arrivals did not share). (figure, upper bound): the same within
        the calibrated rates; past them the back-to-back figure, bounded by the fastest calibrated rate's extra.
        Without a calibration under load, `cpu_range`."""
        calls = total(load)[0]
        per_call = self.per_call_at(calls)
        if per_call is None:
            return self.cpu_range(load)
        mix = self.cpu(CALIBRATION_MIX) / total(CALIBRATION_MIX)[0]
        extra = 1e-6 * calls * max(0.0, per_call - 1e6 * mix)
        if calls > max(r for r, _ in self.under_load):
            return self.cpu(load), self.cpu(load) + extra
        return self.cpu(load) + extra, self.cpu(load) + extra

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
        loaded = {}
        for row in r.get("under_load", ()):
            loaded.setdefault(row["calls_s"], []).append(row["server_cpu_us_per_call"])
        under_load = tuple((rate, statistics.median(costs)) for rate, costs in sorted(loaded.items()))
        return cls(call, key, r["add"]["wall_us"], cores, wake, under_load)


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


def join_after_last_start(n: int, latency: float, round_trips: int = JOIN_ROUND_TRIPS) -> float:
    """The protocol's own time from the last task's start (torch imported) until every task is up, no task waiting
    for a core: the last task's round trips (store, publisher, slot, its endpoint's address, first beat,
    incarnation, up: `round_trips`), and two waits for all (slots, then up) that each see the last key at most one
    POLL late. benchmarks/_scaling_join.py simulates it where the tasks share cores or the store is busy."""
    return round_trips * latency + 2 * POLL


def join_poll_load(n: int, missing: int, window: int = CHECK_WINDOW) -> Load:
    """The store work of the N - `missing` tasks already waiting for all while `missing` keys are unset
    (rendezvous.unmarked): one check of the first `window` missing keys (None: all of them) ten times a second
    each. Largest at missing = N/2."""
    load: Load = {}
    waiting = n - missing
    if missing <= 0 or waiting <= 0:
        return load
    _plus(load, "check", waiting / POLL, missing if window is None else min(missing, window))
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
            "store_calls_s": calls, "store_keys_s": keys, "store_cpu_s": costs.cpu_range(load),
            "store_cpu_loaded_s": costs.cpu_loaded(load), "store_util": util,
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
