"""Each thread's own connections to a part's backup: one per thread, and one to a backup lost while that thread
did not call on it is closed once the thread opens one to the next backup (left open, it would keep a socket
reconnecting to a dead task, its events unread, for the life of the thread)."""

from __future__ import annotations

import threading

from towerflow.ps.server.replication.own_connections import OwnConnections


class _Channel:
    def __init__(self, to: str):
        self.to, self.closed = to, False

    def close(self) -> None:
        self.closed = True


def _connections():
    opened = []

    def open_to(backup):
        opened.append(_Channel(backup))
        return opened[-1]

    return OwnConnections(open_to, lambda line: None), opened


def test_a_thread_opens_its_connection_after_asking_and_reuses_it():
    own, opened = _connections()
    assert own.to("ps:1") is None  # asked for: the op goes the shared way meanwhile
    own.open_wanted("ps:1")
    assert own.to("ps:1") is opened[0] and own.to("ps:1") is opened[0] and len(opened) == 1


def test_a_backup_lost_meanwhile_gets_no_connection():
    own, opened = _connections()
    own.to("ps:1")
    own.open_wanted("ps:1:r1")  # the backup changed before the thread could open it
    assert opened == [] and own.to("ps:1:r1") is None


def test_the_connection_to_a_backup_lost_unseen_is_closed_when_the_next_one_opens():
    own, opened = _connections()
    own.to("ps:1")
    own.open_wanted("ps:1")
    own.to("ps:1:r1")  # another thread saw ps:1 lost; this one moves on to its restart
    own.open_wanted("ps:1:r1")
    assert [c.to for c in opened] == ["ps:1", "ps:1:r1"]
    assert opened[0].closed and not opened[1].closed


def test_each_thread_has_its_own_connection():
    own, opened = _connections()
    own.to("ps:1")
    own.open_wanted("ps:1")

    def other_thread():
        own.to("ps:1")
        own.open_wanted("ps:1")

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(opened) == 2 and opened[0] is not opened[1] and own.to("ps:1") is opened[0]
