"""Failure detection by group watchers, on a stand-in store and a stand-in clock: every loss is published once
and read by everyone, a dead watcher is replaced, and the store's work grows as N, not N²."""

from __future__ import annotations

import json

import pytest

from towerflow.cluster.membership import watch as _watch
from towerflow.devices.spec import DeviceSpec

TIMEOUT = 5.0


class CountingStore:
    """The store calls the watch makes, counting the keys read."""

    def __init__(self):
        self.d, self.keys_read, self.calls = {}, 0, 0

    def check(self, keys):
        self.keys_read, self.calls = self.keys_read + len(keys), self.calls + 1
        return all(k in self.d for k in keys)

    def get(self, key):
        self.keys_read, self.calls = self.keys_read + 1, self.calls + 1
        return self.d[key]

    def multi_get(self, keys):
        self.keys_read, self.calls = self.keys_read + len(keys), self.calls + 1
        return [self.d[k] for k in keys]

    def set(self, key, value):
        self.d[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        self.keys_read, self.calls = self.keys_read + 1, self.calls + 1
        self.d[key] = str(int(self.d.get(key, b"0")) + n).encode()
        return int(self.d[key])


class Cluster:
    """N tasks beating into one store; `tick` is one round of every live task's watch."""

    def __init__(self, n, max_restarts=0, batched=True):
        self.store, self.now = CountingStore(), 0.0
        self.tasks = [DeviceSpec(job="ps", replica=0, task=0)] + [DeviceSpec(job="worker", replica=0, task=i)
                                                                 for i in range(n - 1)]
        self.dead = set()
        for t in self.tasks:
            self.store.set(self._key("beat", t), "0")
            self.store.set(self._key("incarnation", t), "0")
        limit = lambda incarnation: TIMEOUT + (60.0 if incarnation < max_restarts else 0.0)  # noqa: E731
        keys = self.beat_keys if batched else None  # batched: one read of the loss count and the beats a tick
        self.watches = {(t.job, t.task): _watch.Watch(lambda: self.store, t, self.tasks, self.beats, limit,
                                                      clock=lambda: self.now, beat_keys=keys) for t in self.tasks}

    @staticmethod
    def _key(kind, t):
        return f"{kind}/{t.job}/{t.task}"

    def beat_keys(self, tasks):
        return [self._key(kind, t) for kind in ("beat", "incarnation") for t in tasks]

    def beats(self, tasks):
        keys = self.beat_keys(tasks)
        values = [int(v) for v in self.store.multi_get(keys)] if tasks else []
        return list(zip(values[:len(tasks)], values[len(tasks):]))

    def tick(self, seconds=_watch.WATCH_EVERY):
        self.now += seconds
        for t in self.tasks:
            if (t.job, t.task) not in self.dead:
                self.store.add(self._key("beat", t), 1)
        for t in self.tasks:
            if (t.job, t.task) not in self.dead:
                self.watches[(t.job, t.task)].tick()

    def published(self) -> int:
        return int(self.store.d.get(_watch.VERSION, b"0"))

    def lost_seen_by(self, t, among):
        incarnation = lambda job, index: int(self.store.d[f"incarnation/{job}/{index}"])  # noqa: E731
        return [(r["job"], r["index"]) for r in self.watches[(t.job, t.task)].lost_among(among, incarnation)]


def test_groups_are_about_the_square_root_of_the_cluster():
    tasks = [DeviceSpec(job="worker", replica=0, task=i) for i in range(1000)]
    groups = _watch.groups_of(tasks)
    assert len(groups) == 32 and {len(g) for g in groups[:-1]} == {32} and sum(map(len, groups)) == 1000


@pytest.mark.parametrize("batched", [True, False])
def test_a_silent_task_is_published_once_and_every_task_reads_the_loss(batched):
    c = Cluster(49, batched=batched)
    victim = c.tasks[20]
    for _ in range(4):
        c.tick()
    c.dead.add((victim.job, victim.task))
    while not c.published():
        c.tick()
        assert c.now < 30
    assert TIMEOUT < c.now - 2.0 <= TIMEOUT + 2 * _watch.WATCH_EVERY  # silent past the timeout, seen within a look
    for _ in range(10):
        c.tick()
    assert c.published() == 1  # published once, by its group's watcher
    record = json.loads(c.store.d["lost/1"])
    assert (record["job"], record["index"], record["incarnation"]) == ("worker", 19, 0)
    assert record["by"] == "/job:worker/task:13"  # the first member of the victim's group (groups of 7)
    everyone = [t for t in c.tasks if t is not victim]
    assert all(c.lost_seen_by(t, c.tasks) == [("worker", 19)] for t in everyone)
    assert c.lost_seen_by(c.tasks[0], [c.tasks[5]]) == []  # a check names only the tasks it is about


def test_a_dead_watcher_is_published_by_its_group_and_the_next_member_takes_over():
    c = Cluster(49)
    watcher, later = c.tasks[14], c.tasks[18]  # the first member of the third group, and one it watches
    for _ in range(4):
        c.tick()
    c.dead.add((watcher.job, watcher.task))
    for _ in range(16):
        c.tick()
    lost = {(json.loads(c.store.d[f"lost/{n}"])["index"]) for n in range(1, c.published() + 1)}
    assert lost == {13}  # the watcher (worker 13), published by its own group
    killed_at = c.now
    c.dead.add((later.job, later.task))
    while c.lost_seen_by(c.tasks[0], [later]) == []:
        c.tick()
        assert c.now - killed_at < 2 * TIMEOUT
    assert c.now - killed_at <= TIMEOUT + 2 * _watch.WATCH_EVERY  # the new watcher had watched it all along


def test_a_restarted_task_is_not_lost_and_may_restart_waits_for_the_join_timeout():
    c = Cluster(40, max_restarts=1)
    victim = c.tasks[30]
    c.tick()
    c.dead.add((victim.job, victim.task))
    for _ in range(30):  # 15 s: past the heartbeat timeout, within the join timeout a restart has
        c.tick()
    assert c.published() == 0
    c.store.set(f"incarnation/{victim.job}/{victim.task}", "1")  # its next incarnation joins and beats
    c.dead.discard((victim.job, victim.task))
    for _ in range(200):
        c.tick()
    assert c.lost_seen_by(c.tasks[0], c.tasks) == []


@pytest.mark.parametrize("n", [64, 256])
def test_the_store_reads_grow_as_the_cluster_not_as_its_square(n):
    c = Cluster(n)
    for _ in range(4):
        c.tick()
    before = c.store.keys_read
    for _ in range(10):
        c.tick()
        for t in c.tasks:  # and every task checks all its peers once per look, as a worker waiting on the ps does
            c.lost_seen_by(t, c.tasks)
    per_task_per_look = (c.store.keys_read - before) / 10 / n
    assert per_task_per_look < 10  # a direct check reads 2N keys per task per look: 128 and 512 here


def test_a_tick_reads_the_loss_count_and_its_targets_beats_in_one_call():
    c = Cluster(64)
    c.tick()  # the first tick checks that the keys exist (the loss count is created by it)
    c.tick()
    before = c.store.calls
    c.tick()
    alive = len(c.tasks) - len(c.dead)
    assert c.store.calls - before == 2 * alive  # each task's beat and its one batched read
    unbatched = Cluster(64, batched=False)
    for _ in range(2):
        unbatched.tick()
    before = unbatched.store.calls
    unbatched.tick()
    assert unbatched.store.calls - before == 3 * alive  # a beat, the count and the beats (Membership checks too: 4)


def test_a_task_waiting_on_its_peers_is_woken_by_the_tick_that_reads_a_loss():
    """A task waiting on its peers checks them once a second; the watch's tick, twice a second, reads the losses
    published, and wakes the wait as it does: a loss is noticed half a tick after it is published, not a second."""
    import threading

    c = Cluster(49)
    member = c.tasks[30]
    woken = threading.Event()
    for _ in range(4):
        c.tick()
    with c.watches[(member.job, member.task)].waking(woken):
        c.dead.add(("worker", 19))
        while not c.published():
            c.tick()
            assert not woken.is_set() or c.published()
        assert woken.is_set()  # the tick that published it (or the member's next one) read it
    woken.clear()
    c.dead.add(("worker", 40))
    for _ in range(30):
        c.tick()
    assert c.published() == 2 and not woken.is_set()  # out of the block: no longer woken


def test_a_wait_on_a_future_checks_at_once_when_woken_and_returns_when_the_future_is_done():
    import threading
    import time

    import torch

    from towerflow.cluster.membership.membership import wait_for
    from towerflow.errors import PeerLost

    def check():
        raise PeerLost("/job:worker/task:19 stopped answering", task="/job:worker/task:19")

    woken = threading.Event()
    threading.Timer(0.2, woken.set).start()
    started = time.monotonic()
    with pytest.raises(PeerLost):
        wait_for(torch.futures.Future(), check, every=60.0, woken=woken)  # checked when woken, not in a minute
    assert time.monotonic() - started < 10
    future = torch.futures.Future()
    threading.Timer(0.2, lambda: future.set_result(1)).start()
    wait_for(future, check, every=60.0, woken=threading.Event())  # done: returns without a check
