"""A backup holds the primary's ops without applying them until it must: a small primary seeds it anew every so
often, so the backup never runs the optimizer; a queue past its bound is applied; and whenever the mirror's state
is read (a restore, a promotion) it is the primary's, op for op."""

from __future__ import annotations

import pickle

import torch

from towerflow.ps.messages import PushPull
from towerflow.ps.replication_messages import REFRESH_BYTES, REFRESH_FACTOR, ReplicaFrame, SeedOp
from towerflow.ps.server.replication import fresh_seeds as _fresh_seeds
from towerflow.ps.server.replication import mirror as _mirror
from towerflow.ps.server.replication.mirror import Mirror
from towerflow.ps.server.replication import snapshot as _snapshot
from towerflow.ps.policies import AsyncPolicy, SyncPolicy
from tests.ps.test_replication import FakeLink, _grads, _replicated, _same, _service


def _step_all(primary, link, steps, workers=1):
    tickets = {w: primary.pull(w).wait().ticket for w in range(workers)}
    for s in range(steps):
        for w in range(workers):
            reply = primary.push_pull(PushPull(w, tickets[w], _grads(primary, 100 * s + w), 0.1, s + 1))
            link.flush()
            tickets[w] = reply.wait().pulled.ticket


def test_the_backup_holds_ops_unapplied_and_its_state_is_the_primarys_when_read():
    link = FakeLink()
    primary = _service(AsyncPolicy())
    replica, _ = _replicated(primary, link)
    replica.fresh.after = 0  # no fresh seeds: everything since the first one stays queued
    _step_all(primary, link, 6)
    mirror = link.mirrors["ps:1"]
    assert mirror.metrics()["queued"] == 7 and mirror.service is None  # the seed and six pushes, none applied
    state = mirror.state()  # applies them all, in order
    assert mirror.metrics()["queued"] == 0
    restored = _service(AsyncPolicy())
    _snapshot.install(restored, state.snapshot)
    _same(primary, restored)


def test_a_small_primary_seeds_its_backup_anew_so_that_it_never_applies_a_push(monkeypatch):
    monkeypatch.setattr(_fresh_seeds, "REFRESH_BYTES", 0)  # by its state's size alone: a few steps here
    link = FakeLink()
    primary = _service(SyncPolicy(2, 2), 2)
    replica, _ = _replicated(primary, link)
    state_bytes = _snapshot.take(primary).nbytes()
    push_bytes = sum(f.numel() * f.element_size() for f in primary.flats)
    assert replica.fresh.after == REFRESH_FACTOR * state_bytes
    steps = replica.fresh.after // push_bytes // 2 + 3  # past one refresh's worth, two workers a step
    _step_all(primary, link, steps, workers=2)
    mirror = link.mirrors["ps:1"]
    assert replica.refreshes == 1 and replica.seeds == 1
    assert replica.fresh.after == REFRESH_FACTOR * _snapshot.take(primary).nbytes()  # Adam's state counts now
    queued = list(mirror._queue)
    assert isinstance(queued[0][1], SeedOp) and len(queued) < 8  # the pushes before the new seed were dropped
    assert mirror.service is None  # no op was ever applied there
    _same(primary, mirror)  # and read now, it is the primary's, held sync round included


def test_a_tiny_state_is_not_seeded_anew_more_often_than_every_refresh_bytes_of_ops():
    link = FakeLink()
    primary = _service(AsyncPolicy())
    replica, _ = _replicated(primary, link)
    assert REFRESH_FACTOR * _snapshot.take(primary).nbytes() < REFRESH_BYTES == replica.fresh.after


def test_a_queue_past_its_bound_is_applied_by_the_thread_that_fills_it(monkeypatch):
    monkeypatch.setattr(_mirror, "MIRROR_HOLD_BYTES", 200)  # a push here is 60 bytes of gradients
    link = FakeLink()
    primary = _service(AsyncPolicy())
    replica, _ = _replicated(primary, link)
    replica.fresh.after = 0
    _step_all(primary, link, 8)
    mirror = link.mirrors["ps:1"]
    assert mirror.service is not None and mirror.metrics()["queued"] < 4  # applied when the bound was passed
    _same(primary, mirror)


def test_a_large_state_is_never_sent_again_and_its_backup_applies_as_before():
    """A state too large to send every REFRESH_FACTOR of its size in ops (or one with tables) gets no fresh seeds."""
    big = {"w": torch.zeros(1100, 1000)}  # 4.4 MB: REFRESH_FACTOR times that is past half the mirror's bound
    link = FakeLink()
    primary = _service(AsyncPolicy(), values=big)
    replica, _ = _replicated(primary, link)
    assert replica.fresh.after == 0


def _frames(primary, link, steps):
    """The frames a backup receives for `steps` pushes, each push followed by a fresh seed of the state after it
    (copies: the link delivers the originals to its own mirror, whose acks let the replies go)."""
    replica = primary.replica
    frames = []
    ticket = primary.pull(0).wait().ticket
    for s in range(steps):
        reply = primary.push_pull(PushPull(0, ticket, _grads(primary, s), 0.1, s + 1))
        frames.append(pickle.loads(pickle.dumps(link.queue[-1][1])))  # the push's op
        with primary._lock:
            frames.append(ReplicaFrame("model", 0, "ps:0", replica.seq, SeedOp(_snapshot.take(primary), refresh=True)))
        link.flush()
        ticket = reply.wait().pulled.ticket
    return frames


def test_a_fresh_seed_arriving_after_later_ops_keeps_them_and_one_older_than_an_applied_op_is_ignored():
    link = FakeLink()
    primary = _service(AsyncPolicy())
    mirror = Mirror("model", 0)
    mirror.receive(ReplicaFrame("model", 0, "ps:0", 1, SeedOp(_snapshot.take(primary)))).wait()  # as the link's
    replica, _ = _replicated(primary, link)
    replica.fresh.after = 0
    push1, seed1, push2, seed2, push3, seed3 = _frames(primary, link, 3)
    for frame in (push1, push2, seed1, push3):  # seed 1 comes after push 2: push 2 and 3 stay held after it
        mirror.receive(frame).wait()
    assert [s for s, _ in mirror._queue] == [seed1.seq, push2.seq, push3.seq] and mirror.seq == push3.seq
    mirror.wait_applied()  # push 3 applied
    mirror.receive(seed2).wait()  # the state after push 2: applying it would undo push 3
    assert [s for s, _ in mirror._queue] == [] and mirror.applied == push3.seq
    _same(primary, mirror)
    mirror.receive(seed3).wait()  # the state after push 3: taken
    assert [s for s, _ in mirror._queue] == [seed3.seq]
    _same(primary, mirror)
