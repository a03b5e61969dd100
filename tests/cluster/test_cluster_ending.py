"""The end of a cluster against a restarted task's rejoin (cluster/membership/ending.py), on a stand-in store:
whichever comes second sees the other, at every interleaving of their store calls."""

from __future__ import annotations

import pytest

from towerflow.cluster.membership import ending
from towerflow.cluster.server import Server

DONE = ["done/worker/0", "done/worker/1", "done/ps/0"]


class FakeStore:
    """The TCPStore calls the protocol uses, with TCPStore's compare_set semantics. `before` runs a
    callable once just before the n-th call, to interleave another task's calls there."""

    def __init__(self):
        self.d, self.calls, self.before = {}, 0, {}

    def _tick(self):
        self.calls += 1
        hook = self.before.pop(self.calls, None)
        if hook is not None:
            hook()

    def check(self, keys):
        self._tick()
        return all(k in self.d for k in keys)

    def get(self, key):
        self._tick()
        return self.d[key]

    def set(self, key, value):
        self._tick()
        self.d[key] = value.encode() if isinstance(value, str) else value

    def delete_key(self, key):
        self._tick()
        return self.d.pop(key, None) is not None

    def add(self, key, n):
        self._tick()
        value = int(self.d.get(key, b"0")) + n
        self.d[key] = str(value).encode()
        return value

    def compare_set(self, key, expected, new):
        self._tick()
        current = self.d.get(key)
        if (current is None and expected == "") or (current is not None and current.decode() == expected):
            self.d[key] = new.encode()
            return new.encode()
        return current if current is not None else expected.encode()


def _all_done() -> FakeStore:
    store = FakeStore()
    store.d.update({k: b"1" for k in DONE})
    return store


def test_the_cluster_ends_once_every_task_is_done_and_stays_ended():
    store = FakeStore()
    store.d.update({k: b"1" for k in DONE[:2]})
    assert not ending.try_end(store, DONE) and not ending.has_ended(store)
    store.d[DONE[2]] = b"1"
    assert ending.try_end(store, DONE) and ending.try_end(store, DONE) and ending.has_ended(store)


def test_a_restart_whose_earlier_incarnation_was_not_done_changes_nothing():
    store = FakeStore()
    assert ending.take_back_done(store, "done/worker/1") and store.d == {}


def test_a_restart_after_the_end_puts_its_done_back_and_does_not_rejoin():
    store = _all_done()
    assert ending.try_end(store, DONE)
    assert not ending.take_back_done(store, "done/worker/1")
    assert "done/worker/1" in store.d and ending.has_ended(store)


def _race(ender_calls_before_rejoin: int):
    """The ender's try_end with a whole take_back_done run just before its n-th store call."""
    store = _all_done()
    outcome = {}
    store.before[ender_calls_before_rejoin] = lambda: outcome.setdefault(
        "rejoined", ending.take_back_done(store, "done/worker/1"))
    ended = ending.try_end(store, DONE)
    return store, ended, outcome.get("rejoined")


@pytest.mark.parametrize("n", range(1, 7))
def test_an_end_and_a_rejoin_never_both_go_ahead(n):
    store, ended, rejoined = _race(n)
    if rejoined is None:  # try_end made fewer calls than n: the rejoin comes after it
        rejoined = ending.take_back_done(store, "done/worker/1")
    assert ended != rejoined, (n, ended, rejoined)  # exactly one: the cluster ends or the task rejoins
    assert ("done/worker/1" in store.d) == ended  # a rejoined task has taken its done back
    if rejoined:  # the others wait for it; once it is done again the cluster ends
        assert not ending.try_end(store, DONE)
        store.d["done/worker/1"] = b"1"
        assert ending.try_end(store, DONE)


def test_two_restarts_at_once_both_rejoin_and_the_end_waits_for_both():
    store = _all_done()
    store.before[3] = lambda: ending.take_back_done(store, "done/ps/0")  # between the other's delete and its mark
    assert ending.take_back_done(store, "done/worker/1")
    assert not ending.try_end(store, DONE)
    store.d.update({"done/worker/1": b"1", "done/ps/0": b"1"})
    assert ending.try_end(store, DONE)


def test_a_restarted_server_exits_0_when_the_cluster_has_ended(monkeypatch, capsys):
    monkeypatch.setenv("TOWERFLOW_RESTART_COUNT", "1")
    s = Server({"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}, "worker", 1, start=False)
    s.rendezvous.store = _all_done()
    assert ending.try_end(s.rendezvous.store, DONE)
    with pytest.raises(SystemExit) as exit_:
        ending.rejoin_or_exit(s.rendezvous)
    assert exit_.value.code == 0
    assert "/job:worker/task:1: (restart 1) has nothing to rejoin" in capsys.readouterr().err
    assert {"leaving/worker/1", "left/worker/1"} <= set(s.rendezvous.store.d)  # the others' leave does not wait for it


def test_a_run_whose_end_cannot_be_recorded_beyond_the_lease_still_ends_saying_so(capsys):
    class Unreachable:
        def remember(self, name, value):
            raise ConnectionError("no etcd member answers")

    class Rendezvous:
        records, nonce, name = Unreachable(), "n1", "/job:worker/task:0"

    ending.record_end(Rendezvous())  # the work is over: nothing raised
    said = capsys.readouterr().err
    assert "the cluster's run has ended, but recording so beyond the store's lease failed" in said
    assert "no etcd member answers" in said
