"""How many store calls the liveness rules make (docs/scaling.md): a peer check, an end-barrier poll
and a wait for all tasks cost a few calls whatever the cluster's size; on a stand-in store."""

from __future__ import annotations

import time

import pytest

from towerflow.cluster.membership import ending
from towerflow.cluster.server import Server
from towerflow.errors import ClusterError


class CountingStore:
    """TCPStore's calls used here, each counted."""

    def __init__(self):
        self.d, self.calls, self.keys_checked = {}, 0, 0

    def check(self, keys):
        self.calls, self.keys_checked = self.calls + 1, self.keys_checked + len(keys)
        return all(k in self.d for k in keys)

    def get(self, key):
        self.calls += 1
        return self.d[key]

    def multi_get(self, keys):
        self.calls += 1
        return [self.d[k] for k in keys]

    def set(self, key, value):
        self.calls += 1
        self.d[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        self.calls += 1
        self.d[key] = str(int(self.d.get(key, b"0")) + n).encode()
        return int(self.d[key])

    def delete_key(self, key):
        self.calls += 1
        return self.d.pop(key, None) is not None

    def compare_set(self, key, expected, new):
        self.calls += 1
        current = self.d.get(key)
        if (current is None and expected == "") or (current is not None and current.decode() == expected):
            self.d[key] = new.encode()
        return self.d.get(key, expected.encode())


def _cluster(n: int, monkeypatch) -> Server:
    monkeypatch.delenv("TOWERFLOW_RESTART_COUNT", raising=False)
    s = Server({"ps": ["localhost:1"], "worker": [f"localhost:{i + 2}" for i in range(n - 1)]}, "worker", 0, start=False)
    store = CountingStore()
    for t in s.cluster.tasks():
        store.d.update({f"beat/{t.job}/{t.task}": b"1", f"incarnation/{t.job}/{t.task}": b"0",
                        f"up/{t.job}/{t.task}": b"1"})
    s.rendezvous.store = store
    return s


@pytest.mark.parametrize("n, calls", [(8, 4), (64, 3)])
def test_a_peer_check_costs_a_few_store_calls_whatever_the_size(monkeypatch, n, calls):
    """Directly (8 tasks): the done version, the failures, one batched read of the beats. By group (64 tasks,
    watch.py): the beats are read by the watchers, and a check reads the version of the losses instead."""
    s = _cluster(n, monkeypatch)
    seen: dict = {}
    s.check_peers(seen, serving=("ps",))  # the first check reads every done key once
    store = s.rendezvous.store
    before = store.calls
    s.check_peers(seen, serving=("ps",))
    assert store.calls - before == calls and len(seen) == (n - 1 if s.membership.watch is None else 0)


def test_the_done_set_follows_every_change_of_a_done_key(monkeypatch):
    s = _cluster(4, monkeypatch)
    m, rv = s.membership, s.rendezvous
    assert m.done_tasks() == frozenset()
    other = Server(s.cluster, "worker", 1, start=False)
    other.rendezvous.store = rv.store
    ending.mark_done(other.rendezvous)
    assert m.done_tasks() == {("worker", 1)}
    assert ending.take_back_done(rv.store, "done/worker/1")  # a restarted incarnation rejoins
    assert m.done_tasks() == frozenset()


def test_tasks_finishing_one_by_one_cost_a_waiting_task_a_few_calls_each(monkeypatch):
    """At the end of a run every task says it is done, one after another, while the others wait in the end barrier
    or a peer check: each change costs a reader the version and one batched read of what changed, whatever the
    cluster's size (not every task's done and stand-in keys again, 2N calls per change and N³ in all)."""
    s = _cluster(64, monkeypatch)
    m, store = s.membership, s.rendezvous.store
    m.done_tasks()
    others = [t for t in s.cluster.tasks() if (t.job, t.task) != ("worker", 0)]
    for t in others:
        finished = Server(s.cluster, t.job, t.task, start=False)
        finished.rendezvous.store = store
        ending.mark_done(finished.rendezvous)
        before = store.calls
        assert (t.job, t.task) in m.done_tasks()
        assert store.calls - before <= 3  # the version; the change's record: a check and a multi_get
    assert m.done_tasks() == {(t.job, t.task) for t in others}


def test_a_change_counted_and_not_yet_recorded_costs_a_reader_a_few_calls_and_is_read_once_recorded(monkeypatch):
    """Its writer is between the version's bump and the record: a reader keeps what it knew (and the changes recorded
    before it) instead of reading every task's keys, which every task waiting at once made N² calls."""
    s = _cluster(64, monkeypatch)
    m, rv = s.membership, s.rendezvous
    assert m.done_tasks() == frozenset()
    ending.count_change(rv.store, "done/worker/2", True)
    rv.store.set("done/worker/2", "1")
    rv.store.set("done/worker/3", "1")
    rv.store.add(ending.DONE_VERSION, 1)  # worker 3's change: counted, not recorded yet
    before = rv.store.calls
    assert m.done_tasks() == {("worker", 2)}
    assert rv.store.calls - before <= 5  # the version; the records: a batched check, then each one's
    rv.store.set(f"{ending.CHANGE}2", '["done/worker/3", true]')
    assert m.done_tasks() == {("worker", 2), ("worker", 3)}
    m.stand_in("ps", 0, "ps:1")
    assert m.stood_in() == {("ps", 0)} and m.done_tasks() == {("worker", 2), ("worker", 3)}
    m.stand_in("ps", 0, None)
    assert m.stood_in() == frozenset()


def test_a_change_whose_writer_died_before_recording_it_is_read_from_the_keys(monkeypatch):
    s = _cluster(8, monkeypatch)
    m, rv = s.membership, s.rendezvous
    assert m.done_tasks() == frozenset()
    rv.store.set("done/worker/3", "1")
    rv.store.add(ending.DONE_VERSION, 1)  # and its task killed there: the record never comes
    assert m.done_tasks() == frozenset()  # for now: it is recorded next, as a rule
    monkeypatch.setattr(ending, "UNRECORDED_PATIENCE", 0.0)
    assert m.done_tasks() == {("worker", 3)}
    ending.count_change(rv.store, "done/worker/4", True)  # the changes after it are read in a batch again
    rv.store.set("done/worker/4", "1")
    assert m.done_tasks() == {("worker", 3), ("worker", 4)}


def test_a_silent_peer_is_still_found_with_the_batched_reads(monkeypatch):
    s = _cluster(8, monkeypatch)
    seen: dict = {}
    s.check_peers(seen)
    seen["/job:worker/task:3"] = (seen["/job:worker/task:3"][0], time.monotonic() - 60)
    with pytest.raises(ClusterError, match="/job:worker/task:3 at localhost:5 stopped answering"):
        s.check_peers(seen)


def _record_failure(store, job: str, index: int, cause=None, publish: bool = True) -> None:
    """What a failing task leaves in the store: its numbered record, then the one under its name."""
    from towerflow.cluster.membership.failures import FailureRecord, _Board

    board = _Board(store)
    record = board.number(FailureRecord(task=f"/job:{job}/task:{index}", error="PeerLost: gone", pid=1, host="h",
                                        time=0.0, job=job, index=index, cause=cause))
    if publish:
        board.publish(record)


def test_a_recorded_failure_costs_a_peer_check_a_few_calls_whatever_the_size(monkeypatch):
    """When a task records a failure, every other task reads it at once: a read of each peer's failure key would be
    N calls per check (N² at once, which delayed notices by seconds at 256 tasks); only the failed task's is read."""
    s = _cluster(256, monkeypatch)
    store = s.rendezvous.store
    seen: dict = {}
    s.check_peers(seen, serving=("ps",))
    _record_failure(store, "ps", 0, cause="/job:worker/task:254")
    before = store.calls
    with pytest.raises(ClusterError, match="/job:ps/task:0 stopped"):
        s.check_peers(seen, serving=("ps",))
    assert store.calls - before <= 10
    before = store.calls
    with pytest.raises(ClusterError, match="/job:ps/task:0 stopped"):
        s.check_peers(seen, serving=("ps",))  # the record is read once: the next check asks for its task's key only
    assert store.calls - before <= 8
    for index in range(1, 200):  # the others stop in its wake and record it too: one batched read of them all
        _record_failure(store, "worker", index, cause="/job:ps/task:0")
    before = store.calls
    with pytest.raises(ClusterError, match="/job:ps/task:0 stopped"):  # the first to fail is still the one named
        s.check_peers(seen, serving=("ps",))
    assert store.calls - before <= 10


def test_a_failure_counted_and_not_yet_written_is_read_when_it_is(monkeypatch):
    s = _cluster(8, monkeypatch)
    store, m = s.rendezvous.store, s.membership
    tasks = s.cluster.tasks()
    store.add("failures/count", 1)  # its task is between the count and the record (or died there)
    _record_failure(store, "worker", 5)
    assert [f.task for f in m.failures_of(tasks)] == ["/job:worker/task:5"]  # the later record is not held back
    _record_failure_at(store, 1, "worker", 2)
    assert sorted(f.task for f in m.failures_of(tasks)) == ["/job:worker/task:2", "/job:worker/task:5"]


def _record_failure_at(store, number: int, job: str, index: int) -> None:
    from towerflow.cluster.membership.failures import FailureRecord, failed_key

    record = FailureRecord(task=f"/job:{job}/task:{index}", error="RuntimeError: x", pid=1, host="h", time=0.0,
                           job=job, index=index, seq=number)
    store.set(f"failures/{number}", record.to_json())
    store.set(failed_key(job, index), record.to_json())


def test_waiting_for_all_asks_only_the_missing(monkeypatch):
    s = _cluster(64, monkeypatch)
    rv, store = s.rendezvous, s.rendezvous.store
    del store.d["up/worker/40"]
    tasks = s.cluster.tasks()
    before = store.calls
    assert rv.unmarked("up", tasks) == tasks  # the window holding the unset key, asked again next time ...
    assert store.calls - before == 1  # ... in one call
    assert [(t.job, t.task) for t in rv.unmarked("up", tasks, all_of_them=True)] == [("worker", 40)]
    with pytest.raises(ClusterError, match=r"63 of 64 tasks up; missing: /job:worker/task:40 at localhost:42\."):
        rv.wait_for_all("up", time.monotonic() - 1, "tasks up")  # the error still names every missing task
    store.d["up/worker/40"] = b"1"
    before = store.calls
    rv.wait_for_all("up", time.monotonic() + 5, "tasks up")
    assert store.calls - before == 1


def test_a_poll_of_a_large_cluster_joining_asks_about_a_window_of_keys(monkeypatch):
    """1,000 tasks, half of them up (in random order): a waiting task's poll is one call about a window of the missing
    keys, not 500 keys nor a call for each key set (every waiting task polls ten times a second); once all are up, a
    poll costs a few calls."""
    import random

    from towerflow.cluster.membership.rendezvous import CHECK_WINDOW

    s = _cluster(1000, monkeypatch)
    rv, store = s.rendezvous, s.rendezvous.store
    tasks = s.cluster.tasks()
    for t in tasks:
        del store.d[f"up/{t.job}/{t.task}"]
    up = random.Random(0).sample(tasks, 500)
    for t in up:
        store.d[f"up/{t.job}/{t.task}"] = b"1"
    before, keys_before = store.calls, store.keys_checked
    missing = rv.unmarked("up", tasks)
    assert set(missing) >= set(tasks) - set(up)
    assert store.keys_checked - keys_before == CHECK_WINDOW and store.calls - before == 1
    for t in tasks[:CHECK_WINDOW]:  # the first window all up: the poll goes on to the next, twice as long
        store.d[f"up/{t.job}/{t.task}"] = b"1"
    before = store.calls
    assert rv.unmarked("up", missing) == tasks[CHECK_WINDOW:] and store.calls - before == 2
    for t in tasks:
        store.d[f"up/{t.job}/{t.task}"] = b"1"
    before = store.calls
    assert rv.unmarked("up", missing) == []
    assert store.calls - before <= 5  # windows of 64, 128, 256 and the rest


def test_a_task_another_one_stands_in_for_is_not_waited_for_and_costs_no_store_call(monkeypatch):
    """A promoted backup stands in for a ps task whose host is gone: a worker waiting on the ps stops watching that
    task's silence (it may never come back), still in the peer check's four store calls; its next incarnation
    takes its place back as it joins, and is watched again."""
    s = _cluster(8, monkeypatch)
    seen: dict = {}
    s.check_peers(seen, serving=("ps",))
    seen["/job:ps/task:0"] = (seen["/job:ps/task:0"][0], time.monotonic() - 600)
    with pytest.raises(ClusterError, match="/job:ps/task:0 at localhost:1 stopped answering"):
        s.check_peers(seen, serving=("ps",))
    backup = Server(s.cluster, "worker", 1, start=False)
    backup.rendezvous.store = store = s.rendezvous.store
    backup.membership.stand_in("ps", 0, "ps:1")
    assert s.membership.stood_in() == {("ps", 0)}
    before = store.calls
    s.check_peers(seen, serving=("ps",))  # silent for 600 s, and stood in for: no error
    assert store.calls - before == 4  # the done version (the set was just read), the failures, two for the beats
    restarted = Server(s.cluster, "ps", 0, start=False)
    restarted.rendezvous.store = store
    restarted.rendezvous.incarnation = 1
    monkeypatch.setattr("towerflow.cluster.calls.endpoint.start_endpoint", lambda *a: None)
    monkeypatch.setattr(restarted.membership, "_start_heartbeat", lambda: None)
    restarted.membership.join_calls("localhost", None, 15.0)
    assert s.membership.stood_in() == frozenset()
    seen["/job:ps/task:0"] = ((1, 0), time.monotonic() - 600)  # as last seen before the restart
    s.check_peers(seen, serving=("ps",))  # a new incarnation: alive again, watched again
    assert seen["/job:ps/task:0"][0] == (2, 1)


def test_a_task_that_beats_on_is_told_from_one_that_is_gone(monkeypatch):
    """A lost ps task the launcher will not restart is promoted away only once it is gone: its beats stopped for the
    whole wait (a dead process beats at most once more), while one that beats on lives and is not replaced."""
    s = _cluster(4, monkeypatch)
    store = s.rendezvous.store
    beats = iter([0, 1])  # as the wait begins: none; then one late beat, then silence
    real_add = store.add
    monkeypatch.setattr(store, "add", lambda key, n: real_add(key, next(beats, 0) if key == "beat/ps/0" else n))
    started = time.monotonic()
    assert not s.membership.beats_on("ps", 0, 0.5)
    assert time.monotonic() - started >= 0.5
    monkeypatch.setattr(store, "add", lambda key, n: real_add(key, 1 if key == "beat/ps/0" else n))  # beating on
    assert s.membership.beats_on("ps", 0, 30.0)
