"""A part given back by the backup that served it while promoted: the mirror it fed on the next ps task is let go
(its state, its rings), the replies it held go out, and it forwards nothing more; a mirror another incarnation
feeds, or one serving the part itself, stays."""

from __future__ import annotations

import types

import pytest

from towerflow.cluster.link import shm_ring
from towerflow.ps.messages import PushPull, Ticket
from towerflow.ps.replication_messages import DropOp, PushOp, ReplicaFrame, SeedOp, part_key
from towerflow.ps.server import endpoints
from towerflow.ps.server.replication import snapshot as _snapshot
from towerflow.ps.policies import AsyncPolicy
from tests.ps.test_replication import FakeLink, _grads, _replicated, _service

KEY = part_key("model", 0)


def _served_part():
    """A part served by a task (sender "ps:0"), replicated on to the next task's mirror ("ps:2")."""
    link = FakeLink()
    service = _service(AsyncPolicy())
    replica, said = _replicated(service, link, backup="ps:2")
    return service, replica, link, link.mirrors["ps:2"]


def test_a_part_given_back_lets_its_held_replies_go_and_its_backup_drop_the_mirror():
    service, replica, link, mirror = _served_part()
    first = service.push_pull(PushPull(0, Ticket(0), _grads(service, 0), 0.1, 1))
    held = service.push_pull(PushPull(0, first.wait().pulled.ticket, _grads(service, 1), 0.1, 2))
    assert not held.done()  # waits for the backup to hold the first push
    replica.retire()
    assert held.done()  # the state it shows is the one the primary takes back
    assert isinstance(link.queue[-1][1].op, DropOp)
    link.flush()
    assert mirror.service is None and mirror.metrics()["queued"] == 0 and mirror.metrics()["early"] == 0
    forwarded = replica.forwarded
    service.push(0, held.wait().pulled.ticket, _grads(service, 2), 0.1)  # a call already on its way when it was given back
    replica.seed("ps:2")  # a watcher's late reseed
    replica.watch("ps:2#1", "lost")
    assert replica.forwarded == forwarded and link.queue == [] and replica.backup is None
    assert replica.metrics()["degraded"] and replica.retired


def test_a_mirror_fed_by_another_incarnation_or_serving_the_part_is_kept():
    service, replica, link, mirror = _served_part()
    assert not mirror.drop("ps:7")  # not its feeder
    assert mirror.metrics()["queued"] == 1  # the seed, still held
    assert mirror.promote("ps:0") is not None  # now it serves the part itself
    assert not mirror.drop("ps:0") and mirror.service is not None


def test_dropping_a_ring_fed_mirror_stops_the_writer_and_unmaps_the_reader(monkeypatch):
    if not shm_ring.supported():
        pytest.skip("the ring's tickets need x86-64's store order")
    from tests.ps.test_mirror_ring import _ring_fed, _steps

    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch)
    replica.fresh.after = 0
    _steps(primary, link, 4)
    (reader,) = [r for _, r in mirror._rings]
    assert mirror.drop("ps:0")
    assert senders[0].ring.closed and mirror.metrics()["rings"] == 0
    assert reader.records == [] and reader.control is None  # its mapping let go


@pytest.fixture
def served():
    """A fresh ps task's state, the task named /job:ps/task:2."""
    return endpoints.ServedModels(types.SimpleNamespace(name="/job:ps/task:2"))


def _seed(sender: str, seq: int = 1) -> ReplicaFrame:
    return ReplicaFrame(KEY, 0, sender, seq, SeedOp(_snapshot.take(_service(AsyncPolicy()))))


def test_the_backup_lets_go_of_a_given_back_part_and_refuses_its_late_ops(served, capsys):
    assert served.replicate(_seed("ps:1#0")).wait() == 1
    assert (KEY, 0) in served._mirrors
    assert served.replicate(ReplicaFrame(KEY, 0, "ps:1#0", 5, DropOp())).wait() == 5
    assert (KEY, 0) not in served._mirrors
    assert "drops its mirror of /job:ps/task:0's part of 'model@0': ps:1#0, which fed it, gave the part back" \
        in capsys.readouterr().err
    twice = served.replicate(ReplicaFrame(KEY, 0, "ps:1#0", 5, DropOp()))  # sent again on another connection
    assert twice.wait() == 5 and (KEY, 0) not in served._mirrors  # no mirror made for it
    again = served.replicate(_seed("ps:1#0", 9))  # the same task promoted anew later: its seed is taken
    assert again.wait() == 9 and served._mirrors[(KEY, 0)].fed_by == "ps:1#0"


def test_a_late_op_of_a_dropped_feed_is_refused_without_making_a_mirror(served):
    served.replicate(_seed("ps:1#0")).wait()
    served.replicate(ReplicaFrame(KEY, 0, "ps:1#0", 3, DropOp())).wait()
    frame = ReplicaFrame(KEY, 0, "ps:1#0", 2, _push_op())
    with pytest.raises(Exception, match="gave /job:ps/task:0's part of 'model@0' back"):
        served.replicate(frame).wait()
    assert served._mirrors == {}


def _push_op():
    service = _service(AsyncPolicy())
    return PushOp(0, Ticket(0), _grads(service, 0), 0.1, None, "grad")
