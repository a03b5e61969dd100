"""The rules a restarted task and its peers follow, on a stand-in store (no processes, no RPC)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from towerflow.cluster.calls.names import call_name
from towerflow.cluster.server import Server
from towerflow.errors import ClusterError, ClusterJoinError


class FakeStore:
    """The few TCPStore calls the rules use, with the same compare_set semantics."""

    def __init__(self):
        self.d = {}

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, key):
        return self.d[key]

    def multi_get(self, keys):
        return [self.d[k] for k in keys]

    def set(self, key, value):
        self.d[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        value = int(self.d.get(key, b"0")) + n
        self.d[key] = str(value).encode()
        return value

    def compare_set(self, key, expected, new):
        current = self.d.get(key)
        if (current is None and expected == "") or (current is not None and current.decode() == expected):
            self.set(key, new)
        return self.d.get(key, expected.encode())


def _server(monkeypatch, restarts=0, max_restarts=0):
    monkeypatch.setenv("TOWERFLOW_RESTART_COUNT", str(restarts))
    monkeypatch.setenv("TOWERFLOW_MAX_RESTARTS", str(max_restarts))
    s = Server({"worker": ["localhost:1", "localhost:2"]}, "worker", 1, start=False)
    s.rendezvous.store, s.rendezvous.nonce = FakeStore(), "n"
    return s


def test_each_incarnation_has_its_own_call_name(monkeypatch):
    assert [call_name("worker", 1, k) for k in (0, 2)] == ["worker:1", "worker:1:r2"]
    s = _server(monkeypatch)
    assert s.call_name_of("worker", 0) == "worker:0"
    s.rendezvous.store.set("incarnation/worker/0", "3")
    assert s.call_name_of("worker", 0) == "worker:0:r3"


def test_a_silent_task_that_may_restart_gets_the_join_timeout_on_top(monkeypatch):
    s = _server(monkeypatch, max_restarts=1)
    task = [t for t in s.cluster.tasks() if t.task == 0]
    silent = lambda seconds, incarnation=0: {"/job:worker/task:0": ((0, incarnation), time.monotonic() - seconds)}  # noqa: E731
    s.membership.check_heartbeats(task, silent(20))  # 20 s < 15 + 60: waits on
    with pytest.raises(ClusterError, match=r"no heartbeat for 80 s \(it may be restarted: 0 of 1 restarts used"):
        s.membership.check_heartbeats(task, silent(80))
    s.rendezvous.store.set("incarnation/worker/0", "1")
    seen = silent(20)
    s.membership.check_heartbeats(task, seen)  # a new incarnation counts as a sign of life, before its first beat
    assert seen["/job:worker/task:0"][0] == (0, 1) and time.monotonic() - seen["/job:worker/task:0"][1] < 1
    with pytest.raises(ClusterError, match="no heartbeat for 15 s and it never finished"):  # its one restart is used up
        s.membership.check_heartbeats(task, silent(20, incarnation=1))


def test_a_task_watched_again_after_it_was_done_gets_a_fresh_wait(monkeypatch):
    """A ps task is done from its start, so nobody watches it; its restarted incarnation takes that done back before
    its first beat. The old incarnation's silence while it was not watched must not count then."""
    s = _server(monkeypatch)
    task = [t for t in s.cluster.tasks() if t.task == 0]
    seen = {"/job:worker/task:0": ((0, 0), time.monotonic() - 80)}  # last watched 80 s ago, when it had not joined
    s.membership.check_heartbeats([], seen)  # done (or stood in for): not watched
    s.membership.check_heartbeats(task, seen)  # watched again: a fresh wait, not 80 s of silence
    assert time.monotonic() - seen["/job:worker/task:0"][1] < 1
    with pytest.raises(ClusterError, match="no heartbeat for 15 s"):  # a task watched all along is still given up
        s.membership.check_heartbeats(task, {"/job:worker/task:0": ((0, 0), time.monotonic() - 80)})


def test_a_restarted_task_takes_over_a_dead_holders_slot_but_not_a_live_ones(monkeypatch):
    s = _server(monkeypatch, restarts=1)
    live = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "incarnation": 0})
    s.rendezvous.store.set("slot/worker/1", live)
    with pytest.raises(ClusterJoinError, match=r"cannot take over its slot: the process holding it \(pid \d+"):
        s.rendezvous.claim_slot()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s.rendezvous.store.set("slot/worker/1", json.dumps({"pid": dead.pid, "host": socket.gethostname(), "incarnation": 0}))
    s.rendezvous.claim_slot()
    assert json.loads(s.rendezvous.store.get("slot/worker/1"))["incarnation"] == 1
    fresh = _server(monkeypatch)  # a first start never takes a held slot
    fresh.rendezvous.store.set("slot/worker/1", live)
    with pytest.raises(ClusterJoinError, match="is already taken by another process"):
        fresh.rendezvous.claim_slot()


def _beating(store, key, every=0.05, times=50):
    import threading

    def run():
        for _ in range(times):
            store.add(key, 1)
            time.sleep(every)

    threading.Thread(target=run, daemon=True).start()


def test_a_lost_incarnation_that_goes_on_beating_lives_on_and_the_caller_connects_again(monkeypatch):
    """A connection can be lost while its task lives on (cut off, a stall): no restart will come, so a wait that
    allows it returns the lost name itself once that incarnation has beaten a few times (in a job that allows
    restarts: one that allows none ends on a lost connection as on a lost task, below)."""
    from towerflow.cluster.membership import membership

    monkeypatch.setattr(membership, "BEAT_EVERY", 0.05)
    s = _server(monkeypatch, max_restarts=1)
    _beating(s.rendezvous.store, "beat/worker/0")
    start = time.monotonic()
    assert s.wait_for_restart("worker", 0, "worker:0", "closed", timeout=10, alive_ok=True) == "worker:0"
    assert time.monotonic() - start < 5


def test_a_silent_lost_incarnation_is_waited_for_and_one_restart_beat_is_not_life(monkeypatch):
    from towerflow.cluster.membership import membership

    monkeypatch.setattr(membership, "BEAT_EVERY", 0.05)
    s = _server(monkeypatch, max_restarts=1)
    store = s.rendezvous.store

    def restart():  # the new incarnation beats once, then names itself
        time.sleep(0.5)
        store.add("beat/worker/0", 1)
        time.sleep(0.3)
        store.set("incarnation/worker/0", "1")

    import threading
    threading.Thread(target=restart, daemon=True).start()
    assert s.wait_for_restart("worker", 0, "worker:0", "killed", timeout=10, alive_ok=True) == "worker:0:r1"
    s0 = _server(monkeypatch, max_restarts=0)  # no restart allowed: lost at once, beating or not
    _beating(s0.rendezvous.store, "beat/worker/0")
    start = time.monotonic()
    with pytest.raises(ClusterError, match="will not be restarted"):
        s0.wait_for_restart("worker", 0, "worker:0", "closed", timeout=10, alive_ok=True)
    assert time.monotonic() - start < 1


def _waiting_for_ps0_stood_in_by_ps1(monkeypatch) -> Server:
    """A worker whose wait for a restart of ps:0 (which may be restarted) gives up after 0.3 s, while ps:1 serves
    ps:0's part (a promoted backup stands in for it); tasks beat every 0.05 s."""
    from towerflow.cluster.membership import membership

    monkeypatch.setenv("TOWERFLOW_RESTART_COUNT", "0")
    monkeypatch.setenv("TOWERFLOW_MAX_RESTARTS", "1")
    monkeypatch.setattr(membership, "BEAT_EVERY", 0.05)  # as often as `_beating` beats
    s = Server({"ps": ["localhost:1", "localhost:2"], "worker": ["localhost:3"]}, "worker", 0, start=False)
    s.rendezvous.store, s.rendezvous.nonce = FakeStore(), "n"
    s.membership.heartbeat_timeout, s.membership.join_timeout = 0.2, 0.1
    s.membership.stand_in("ps", 0, "ps:1")
    return s


def test_a_lost_task_is_waited_for_past_the_timeout_while_the_task_standing_in_for_it_lives(monkeypatch):
    s = _waiting_for_ps0_stood_in_by_ps1(monkeypatch)
    store = s.rendezvous.store
    _beating(store, "beat/ps/1", times=40)

    def restart():
        time.sleep(1.0)
        store.set("incarnation/ps/0", "1")

    import threading
    threading.Thread(target=restart, daemon=True).start()
    start = time.monotonic()
    assert s.wait_for_restart("ps", 0, "ps:0", "killed") == "ps:0:r1"
    assert time.monotonic() - start >= 1.0  # three times the timeout


@pytest.mark.timeout(10)  # the hang it guards against fails instead
@pytest.mark.parametrize("stand_in_gone, why", [
    ("silent", r"fewer than 3 heartbeats in 0.2 s"),
    ("restarted", "it was restarted as ps:1:r1"),
    ("failed", "failed: RuntimeError: out of memory"),
])
def test_a_lost_task_whose_stand_in_is_gone_too_ends_the_wait_naming_both(monkeypatch, stand_in_gone, why):
    """Nobody does the lost task's work any more: waiting on for it would hang every caller."""
    from towerflow.cluster.membership.failures import FailureRecord
    from towerflow.errors import ClusterTimeoutError

    s = _waiting_for_ps0_stood_in_by_ps1(monkeypatch)
    store = s.rendezvous.store
    if stand_in_gone != "silent":  # a new incarnation, or one that fails as it goes on beating for a while
        _beating(store, "beat/ps/1", times=40)
    if stand_in_gone == "restarted":
        store.set("incarnation/ps/1", "1")
    if stand_in_gone == "failed":
        store.set("failed/ps/1", FailureRecord(task="/job:ps/task:1", error="RuntimeError: out of memory", pid=1,
                                                 host="h", time=0.0, job="ps", index=1).to_json())
    start = time.monotonic()
    with pytest.raises(ClusterTimeoutError) as raised:
        s.wait_for_restart("ps", 0, "ps:0", "killed")
    assert time.monotonic() - start < 1.5
    message = str(raised.value)
    assert message.startswith("/job:worker/task:0 lost /job:ps/task:0 (killed)")
    assert "/job:ps/task:1, which stood in for it as ps:1, is gone too" in message
    assert re.search(why, message)
    assert "newest checkpoint" in message and "--max-restarts" in message
    assert raised.value.missing == ("/job:ps/task:0", "/job:ps/task:1")


@pytest.mark.timeout(10)
def test_a_stand_in_killed_right_after_a_beat_is_told_gone_at_the_first_look(monkeypatch):
    """Its last beats fall between the wait's start and its first look: the look itself waits for it to beat on
    rather than comparing with a count read a whole timeout before, which took a second timeout."""
    from towerflow.errors import ClusterTimeoutError

    s = _waiting_for_ps0_stood_in_by_ps1(monkeypatch)
    s.membership.join_timeout = 1.0  # the first look 1.2 s after the wait begins
    _beating(s.rendezvous.store, "beat/ps/1", times=20)  # beats for 1 s, then is killed
    start = time.monotonic()
    with pytest.raises(ClusterTimeoutError, match="/job:ps/task:1, which stood in for it as ps:1, is gone too"):
        s.wait_for_restart("ps", 0, "ps:0", "killed")
    assert time.monotonic() - start < 2.0  # the first look (1.2 s) and the heartbeat timeout, not a second look (2.4 s)


def test_a_stand_in_is_given_time_for_its_beats_however_short_the_heartbeat_timeout(monkeypatch):
    """A heartbeat timeout shorter than the beats a look waits for must not make a live stand-in look gone."""
    s = _waiting_for_ps0_stood_in_by_ps1(monkeypatch)
    s.membership.heartbeat_timeout = 0.05  # one beat's time: three beats cannot fit in it
    _beating(s.rendezvous.store, "beat/ps/1", times=40)
    assert s.membership._stand_in_gone("ps", 0) == ("ps:1", None)
