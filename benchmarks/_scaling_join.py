"""The join of a cluster after its last task starts, simulated task by task: what benchmarks/_scaling_model.py's
closed forms cannot say once the tasks share a few cores, where the polls of those waiting and the work of those
joining take the cores from each other.

From the last task's start, every other task waits for all slots (rendezvous.wait_for_all, a poll every POLL s);
the last task meets (its meet's CPU, and its calls); once its slot is taken, each waiting task's next poll sees
every slot, and each task does its part of the join (its endpoint, its first beat, its address: the post-meet
work) and then waits for all up the same way; the join ends when the last task's poll sees every task up. A poll
and each piece of work need CPU of the host (shared equally by what is runnable, at most one core each) and of the
store (one event loop, likewise shared). On a shared machine (the measured runs) the store's work takes the same
cores; with a host per task (the predictions) each task has a core of its own and the store a host of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLL = 0.1  # rendezvous.POLL
WAIT_SLOTS, POST, WAIT_UP, UP = 0, 1, 2, 3


@dataclass(frozen=True)
class JoinCosts:
    """What the join asks of the cores (s of CPU): each measured by a calibration, not by the runs it is checked on."""

    meet_cpu: float  # a task's meet: connect, claim its slot (a run of 8 tasks, where none waits for a core)
    post_meet_cpu: float  # its work from the end of its meet to up (same run)
    poll_cpu: float  # a waiting task's poll, with as many processes polling on the host (poll_calibration.py)
    task_cpu: float  # an up task's steady work, s per s (beats and ticks)
    poll_store: float  # the store's CPU per poll (a check of a window of keys and one of a single key)
    post_store: float  # the store's CPU for a task's calls from its meet to up


def fair_share(need: np.ndarray, capacity: float, cap: float) -> np.ndarray:
    """What each job gets of `capacity` in one step: an equal share, at most `cap` (one core) and at most what it still
    needs, with what a job finishing early leaves going to the others (max-min fairness). Charging every job a full
    step's share instead would keep the store busy for a whole step for a call of a tenth of it, and take those
    cores from the tasks (at 64 tasks, a join 11% slower than with a step ten times shorter)."""
    if need.size == 0 or capacity <= 0.0:
        return np.zeros_like(need)
    ordered = np.sort(need)
    served = np.cumsum(ordered)  # the first j+1 jobs served in full ...
    at_level = served + ordered * np.arange(need.size - 1, -1, -1)  # ... and the rest given as much as the (j+1)th
    j = int(np.searchsorted(at_level, capacity))
    level = ordered[-1] if j == need.size else (capacity - (served[j - 1] if j else 0.0)) / (need.size - j)
    return np.minimum(need, min(level, cap))


def simulate(n: int, costs: JoinCosts, cores: float, shared: bool, store_steady: float = 0.0, dt: float = 0.001,
             limit: float = 600.0, seed: int = 0) -> float:
    """Seconds from the last task's start until every task is up. `cores`: the host's cores, shared by the `n`
    tasks (and the store when `shared`); with a host per task pass `cores=n`. `store_steady`: the store's CPU
    already busy (s per s) with the up tasks' beats and checks."""
    if store_steady >= 1.0:  # the store's loop is busy all the time already: polls are never all answered
        return float("inf")
    rng = np.random.default_rng(seed)
    state = np.full(n, WAIT_SLOTS)
    host_left = np.zeros(n)  # CPU still owed to the task's current piece of work on the host
    store_left = np.zeros(n)  # and then by the store
    next_poll = rng.uniform(0.0, POLL, n)  # the waiting tasks' polls, each on its own phase
    polling = np.zeros(n, dtype=bool)  # a poll under way (its CPU, then its calls)
    last = n - 1
    state[last], next_poll[last] = POST, np.inf  # the last task's meet, then its part of the join
    host_left[last], store_left[last] = costs.meet_cpu + costs.post_meet_cpu, costs.post_store
    slots_taken, up_keys, t = False, 0, 0.0
    while t < limit:
        due = (~polling) & (state != POST) & (state != UP) & (next_poll <= t)
        polling |= due
        host_left[due] += costs.poll_cpu
        store_left[due] += costs.poll_store
        on_host = host_left > 0
        on_store = (~on_host) & (store_left > 0)
        store_done = fair_share(store_left[on_store], max(0.0, 1.0 - store_steady) * dt, cap=dt)
        store_left[on_store] -= store_done
        free = cores - ((store_done.sum() / dt + store_steady) if shared else 0.0) - costs.task_cpu * up_keys
        host_left[on_host] -= fair_share(host_left[on_host], max(0.0, free) * dt, cap=dt)
        t += dt
        if not slots_taken and host_left[last] <= costs.post_meet_cpu:  # the last task's meet is done: its slot taken
            slots_taken = True
        finished = (host_left <= 0) & (store_left <= 0)
        # a poll's answer: the keys as they are now
        answered = finished & polling
        polling &= ~answered
        sees_slots = answered & (state == WAIT_SLOTS)
        if slots_taken and sees_slots.any():
            state[sees_slots] = POST
            host_left[sees_slots], store_left[sees_slots] = costs.post_meet_cpu, costs.post_store
        waiting_on = answered & (state != POST)
        next_poll[waiting_on] = t + POLL
        # a task's part of the join done: its up key is set, and it waits for all up (polling at once)
        joined = (state == POST) & (host_left <= 0) & (store_left <= 0)
        if joined.any():
            up_keys += int(joined.sum())
            state[joined], next_poll[joined] = WAIT_UP, t
        if up_keys == n:
            sees_all = answered & (state == WAIT_UP)
            state[sees_all] = UP
            if (state == UP).all():
                return t
    return float("inf")
