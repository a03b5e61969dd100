"""A same-host backup fed through a ring (`mirror_link.py`): the primary's pushes count as held once written and
nobody wakes for them; the mirror takes them when another op arrives or its state is read, in order with the ops of
the other paths; a fresh seed makes them moot; a promoted mirror stops its writer."""

from __future__ import annotations

import concurrent.futures
import pytest
import torch

from towerflow.cluster.link import shm_ring
from towerflow.ps.messages import PushPull, Ticket
from towerflow.ps.server.replication import fresh_seeds as _fresh_seeds
from towerflow.ps.server.replication import mirror_link as _mirror_link
from towerflow.ps.policies import AsyncPolicy
from tests.ps.test_replication import FakeLink, _grads, _replicated, _same, _service

pytestmark = pytest.mark.skipif(not shm_ring.supported(), reason="the ring's tickets need x86-64's store order")


class _FakeSlots:
    """The link's slots and pipe, in process: a call hands the op to the mirror at once."""

    def __init__(self, specs, mirror):
        self.requests = [[torch.zeros(n, dtype=d) for n, d in specs] for _ in range(2)]
        self.handle = _mirror_link.handler(mirror.receive)
        self.calls, self._replies, self.gone = 0, {}, False

    def call(self, slot, head):
        self.calls += 1
        self._replies[slot] = self.handle(head, self.requests[slot], [])

    def reply(self, slot):
        return self._replies.pop(slot).value()

    def peer_gone(self):
        return self.gone

    def close(self):
        pass


def _ring_fed(monkeypatch, slots=64, workers=1):
    """A primary whose pushes reach its backup's mirror through a real ring (and fake slots when it is full); one
    ring per thread that pushes, as a link thread per worker has."""
    monkeypatch.setattr(_mirror_link, "RING_MAX_SLOTS", slots)
    monkeypatch.setattr(_mirror_link, "RING_MIN_SLOTS", 1)
    link = FakeLink()
    primary = _service(AsyncPolicy(), num_workers=workers)
    senders = []

    def direct(to):
        mirror = link.mirrors[to]
        specs = tuple((f.numel(), f.dtype) for f in primary.flats)
        ring = _mirror_link._open_ring(specs, "ps:0")
        mirror.add_ring("ps:0", shm_ring.RingReader(ring.offer))
        ring.unlink()
        senders.append(_mirror_link.LinkSender(_FakeSlots(specs, mirror), specs, lambda f: link.call(to, f), ring))
        return senders[-1]

    replica, said = _replicated(primary, link, direct=direct)
    return primary, replica, link, link.mirrors["ps:1"], senders, said


def _steps(primary, link, steps, first=0):
    ticket = primary.pull(0).wait().ticket
    for s in range(first, first + steps):
        reply = primary.push_pull(PushPull(0, ticket, _grads(primary, s), 0.1, s + 1))
        link.flush()  # the first push goes the shared way; the thread's own connection opens after it
        ticket = reply.wait().pulled.ticket


def test_pushes_in_the_ring_are_held_at_once_and_read_only_with_the_state(monkeypatch):
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch)
    replica.fresh.after = 0
    _steps(primary, link, 12)
    (sender,) = senders
    assert sender.ring_ops == 11 and sender.link.calls == 0  # every push after the first: no slot, no pipe
    assert mirror.metrics()["queued"] == 2  # the seed and the first push; the ring's were not taken yet
    assert replica.metrics()["lag"] <= 1  # each counted as held when written (the last when its reply reads it)
    _same(primary, mirror)  # read now: the ring's pushes taken and applied, in order


def test_a_workers_reply_never_waits_for_another_workers_next_push(monkeypatch):
    """Each worker's pushes reach the ps on a thread of their own, each with its own ring. A push in a ring is held by
    the backup once written, so it counts at once: were the newest one counted only at that thread's next push,
    the backup's acks, which count in order, would hold worker 0's reply until worker 1 pushed again."""
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch, workers=2)
    replica.fresh.after = 0
    threads = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(2)]  # one thread per worker, as its link's
    ticket = primary.pull(0).wait().ticket

    def push(worker, step):
        return primary.push_pull(PushPull(worker, ticket, _grads(primary, step), 0.1, step + 1))

    try:
        for worker in (0, 1):  # the first push goes the shared way; each thread's own ring opens after it
            threads[worker].submit(push, worker, 0).result()
        link.flush()
        for step, worker in enumerate((0, 1, 1, 1, 0, 0, 1, 0, 0, 0), start=1):  # now one, now the other ahead
            reply = threads[worker].submit(push, worker, step).result()
            assert reply.done(), f"worker {worker}'s reply to step {step} waits for the other worker's next push"
        assert sorted(s.ring_ops for s in senders) == [4, 6]
    finally:
        for t in threads:
            t.shutdown()
    _same(primary, mirror)


def test_no_reply_waits_for_a_fresh_seed_and_a_primary_lost_before_it_arrives_loses_nothing(monkeypatch):
    """A fresh seed is the state after ops the backup holds already: it takes no number of its own, so the replies
    after it wait for nothing while it travels, and a primary lost before it arrives leaves a mirror with every op."""
    monkeypatch.setattr(_fresh_seeds, "REFRESH_FACTOR", 0.01)  # a fresh seed after every push
    monkeypatch.setattr(_fresh_seeds, "REFRESH_BYTES", 0)
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch)
    _steps(primary, link, 2)  # this thread's ring is open
    link.flush()
    ticket = primary.pull(0).wait().ticket
    for s in range(2, 8):  # the fresh seeds stay queued on the connection, never delivered
        reply = primary.push_pull(PushPull(0, ticket, _grads(primary, s), 0.1, s + 1))
        assert reply.done(), f"the reply to push {s} waits for a fresh seed's ack"
        ticket = reply.wait().pulled.ticket
    refreshes = [frame for _, frame, _ in link.queue if frame.op.refresh]
    numbers = [f.seq for f in refreshes]  # each the number of the last op it includes: no number of its own
    assert len(numbers) >= 5 and numbers == sorted(set(numbers)) and numbers[-1] == replica.seq
    assert mirror.promote("ps:0") is not None  # the primary is lost with its fresh seeds in flight
    _same(primary, mirror)


def test_a_full_ring_sends_the_op_by_its_slot_and_the_mirror_takes_the_ring_first(monkeypatch):
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch, slots=4)
    replica.fresh.after = 0
    _steps(primary, link, 12)
    (sender,) = senders
    assert sender.link.calls == 2 and sender.ring_ops == 9  # 4, slot (the ring emptied), 4, slot, 1
    assert mirror.seq == 12  # the seed, the shared-way push, then everything up to the second slot's op, in order
    _same(primary, mirror)


def test_a_tiny_parts_ring_never_fills_its_backup_is_seeded_anew_first(monkeypatch):
    """A part whose pushes are a few bytes would take many of them to reach the bytes of a fresh seed; its backup takes
    the ring's records only at a seed, so it is seeded anew after half as many ops as a ring holds, and no push has to
    wake it through a slot."""
    monkeypatch.setattr(_fresh_seeds, "REFRESH_OPS", 4)
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch, slots=8)
    assert replica.fresh.after == _fresh_seeds.REFRESH_BYTES  # far more than 30 pushes' bytes
    for start in range(0, 30, 3):
        _steps(primary, link, 3, first=start)
        link.flush()  # the fresh seeds reach the backup
    (sender,) = senders
    assert replica.refreshes >= 6 and sender.link.calls == 0 and sender.ring_ops == 29
    _same(primary, mirror)


def test_one_workers_ring_never_fills_its_backup_is_seeded_anew_at_half(monkeypatch):
    """One worker's link thread fills its ring alone, as fast as the bytes of a fresh seed grow (what a ring holds is
    what a refreshed mirror holds): the backup is seeded anew once the ring is half full, before any push has to go
    through a slot and make the backup copy out every record."""
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch, slots=8)
    assert replica.fresh.after == _fresh_seeds.REFRESH_BYTES and _fresh_seeds.REFRESH_OPS > 30
    for start in range(0, 30, 3):
        _steps(primary, link, 3, first=start)
        link.flush()
    (sender,) = senders
    assert replica.refreshes >= 6 and sender.link.calls == 0 and sender.ring_ops == 29
    _same(primary, mirror)


def test_a_half_full_ring_is_seeded_anew_once_not_again_while_the_seed_travels(monkeypatch):
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch, slots=8)
    _steps(primary, link, 1)
    ticket = primary.pull(0).wait().ticket
    for s in range(1, 8):  # nothing delivered: the fresh seed is on its way all along
        ticket = primary.push_pull(PushPull(0, ticket, _grads(primary, s), 0.1, s + 1)).wait().pulled.ticket
    assert replica.refreshes == 1 and senders[0].ring_ops == 7  # at 4 records; 3 written since
    link.flush()
    _same(primary, mirror)


def test_a_fresh_seed_makes_the_rings_records_moot(monkeypatch):
    monkeypatch.setattr(_fresh_seeds, "REFRESH_FACTOR", 0.01)  # a fresh seed after every push
    monkeypatch.setattr(_fresh_seeds, "REFRESH_BYTES", 0)
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch)
    _steps(primary, link, 6)
    assert replica.refreshes >= 5
    assert len(mirror._queue) <= 2  # the newest seed, and at most the push after it
    _same(primary, mirror)


def test_a_promoted_mirror_takes_what_was_written_before_and_stops_the_writer(monkeypatch):
    primary, replica, link, mirror, senders, said = _ring_fed(monkeypatch)
    replica.fresh.after = 0
    _steps(primary, link, 5)
    service = mirror.promote("ps:0")
    assert service is not None and service.coordinator.global_step == primary.coordinator.global_step
    assert senders[0].ring.closed
    primary.push(0, Ticket(primary.coordinator.global_step), _grads(primary, 99), 0.1)  # the old primary thawed
    assert any("refused an op" in text and "promoted" in text for text in said), said
    assert service.coordinator.global_step == primary.coordinator.global_step - 1  # the mirror took none of it


def test_a_writer_gone_leaves_its_records_with_the_mirror(monkeypatch):
    primary, replica, link, mirror, senders, _ = _ring_fed(monkeypatch)
    replica.fresh.after = 0
    _steps(primary, link, 6)
    (ring,) = [r for _, r in mirror._rings]
    mirror.drop_ring(ring)  # its link ended: the primary's process is gone
    assert mirror.metrics()["rings"] == 0 and mirror.seq == 7
    _same(primary, mirror)
