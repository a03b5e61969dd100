"""Replicated ps shards without a cluster: a primary `ShardService` forwarding to a `Mirror` through a fake
connection the test drives (frames pickled as the wire would, acknowledged when the test says)."""

from __future__ import annotations

import concurrent.futures
import pickle
import threading
import time

import pytest
import torch

from towerflow.ps.layout import plan_layout
from towerflow.errors import ClusterTimeoutError, ParameterServerError, PeerLost
from towerflow.ps.messages import PushPull, RowPush, RowRead, Ticket
from towerflow.ps.replication_messages import MirrorState, check_ps_replicas, check_replica_lag
from towerflow.ps.server.replication import snapshot as _snapshot
from towerflow.ps.server.replication.mirror import Mirror
from towerflow.ps.policies import AsyncPolicy, SSPPolicy, SyncPolicy
from towerflow.ps.server.replication.replicator import Replicator
from towerflow.ps.server.service import ShardService
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_optimizers import SparseAdam
from towerflow.ps.tables.table_shards import TableShards
from towerflow.ps.worker.from_mirrors import holds_all_it_answered, stands_for_the_lost


class Lost(RuntimeError):
    """What the fake connection fails a frame with when the backup is gone."""


class FakeLink:
    """The one ordered connection from a primary to its backups: frames queue until `flush` delivers them."""

    def __init__(self):
        self.mirrors = {}  # backup name -> Mirror
        self.queue = []  # (to, frame, future)
        self.restarted = {}  # backup task -> the name its next incarnation has
        self._lock = threading.Lock()  # a reseed queues its frame from the watcher thread

    def call(self, to, frame):
        future = torch.futures.Future()
        with self._lock:
            self.queue.append((to, pickle.loads(pickle.dumps(frame)), future))
        return future

    def flush(self, order=None):
        """Deliver the queued frames, in `order` (indices into the queue; the others stay queued)."""
        with self._lock:
            queue = self.queue
            order = range(len(queue)) if order is None else order
            self.queue = [f for i, f in enumerate(queue) if i not in set(order)]
        for i in order:
            to, frame, future = queue[i]
            mirror = self.mirrors.get(to)
            if mirror is None:
                future.set_exception(Lost(f"{to} is gone"))
            else:
                mirror.receive(frame).add_done_callback(lambda ack, f=future: _relay(ack, f))

    def wait_for_restart(self, task, lost, cause):
        return self.restarted[task]


def _wait_seeding(replica, link, backup: str, deadline_s: float = 10.0) -> None:
    """Until the watcher thread has made `backup` the backup and queued its seed (it sets the one, then the other)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not (replica.backup == backup and any(to == backup for to, _, _ in link.queue)):
        time.sleep(0.01)


def _relay(ack, future) -> None:
    """The mirror's answer, an ack or its refusal, as the connection's."""
    try:
        future.set_result(ack.value())
    except Exception as e:
        future.set_exception(e)


def _service(policy, num_workers=1, tables=None, values=None):
    values = values or {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    layout = plan_layout(values, 1)
    return ShardService(layout.on_task(0), layout.pack(0, values), torch.optim.Adam, {"lr": 0.1}, policy,
                        num_workers, tables)


def _replicated(service, link, backup="ps:1", **options):
    said = []
    replica = Replicator("model", 0, "ps:0", 1, service._lock, lambda: _snapshot.take(service), link.call,
                         lambda e: isinstance(e, Lost), link.wait_for_restart, said.append, **options)
    service.replica = replica
    link.mirrors[backup] = Mirror("model", 0)
    replica.seed(backup)
    link.flush()
    return replica, said


def _equal(x, y) -> bool:
    """Structural equality, tensors compared by value (pickles of equal tensors may differ)."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    return x == y


def _same(a: ShardService, b) -> None:
    """`a` equals `b`, a service or a mirror (once it has applied what it holds)."""
    if isinstance(b, Mirror):
        b.wait_applied()
        b = b.service
    sa, sb = _snapshot.take(a), _snapshot.take(b)
    for d in sa.values:
        assert torch.equal(sa.values[d], sb.values[d])
    assert _equal(sa.optimizer_state, sb.optimizer_state)
    ca, cb = sa.coordinator, sb.coordinator
    assert (ca.global_step, ca.clocks, ca.active, ca.held, dict(ca.pushes_by_worker), ca.applied_updates) == \
           (cb.global_step, cb.clocks, cb.active, cb.held, dict(cb.pushes_by_worker), cb.applied_updates)
    assert (sa.summed, sa.lr, sa.push_kind) == (sb.summed, sb.lr, sb.push_kind)
    if sa.tables is not None:
        assert _equal(sa.tables.state_dict(), sb.tables.state_dict())


def _grads(service, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(f.shape, generator=g) for f in service.flats]


def test_a_reply_waits_until_the_backup_holds_the_workers_previous_push():
    """The worker keeps its last two pushes, so its reply waits only for the one before; a finish, which nobody
    could send again, waits for everything."""
    link = FakeLink()
    primary = _service(AsyncPolicy(), num_workers=2)
    _replicated(primary, link)
    first = primary.push_pull(PushPull(0, Ticket(0), _grads(primary, 0), 0.1, 1))
    assert first.done()  # no earlier push to wait for
    second = primary.push_pull(PushPull(0, first.value().pulled.ticket, _grads(primary, 1), 0.05, 2))
    assert not second.done()  # the first push is not at the backup yet
    link.flush(order=[0])  # the backup acknowledges the first push only
    assert second.done()
    other = primary.push_pull(PushPull(1, Ticket(0), _grads(primary, 2), None, 1))
    finished = primary.finish(1)
    assert other.done() and not finished.done()  # worker 1's first push; a finish waits for every op
    link.flush()
    assert finished.done()
    _same(primary, link.mirrors["ps:1"])
    m = primary.replica.metrics()
    assert (m["ops_forwarded"], m["lag"], m["degraded"], m["seeds"]) == (5, 0, False, 1)


def test_sync_held_gradients_finish_and_rejoin_replicate_in_order():
    """Two workers in sync: a held gradient, a restarted worker's rejoin, a finish: the mirror decides alike,
    even when the frames arrive out of order."""
    link = FakeLink()
    primary = _service(SyncPolicy(2, 2), num_workers=2)
    _replicated(primary, link)
    t = Ticket(0)
    primary.push(0, t, _grads(primary, 1), 0.1)
    primary.rejoin(0, restarted=True)
    primary.push(1, t, _grads(primary, 2), 0.1)
    primary.push(0, Ticket(1), _grads(primary, 3), 0.1)  # held: worker 1 has not pushed step 1
    link.flush(order=[3, 1, 0, 2])
    _same(primary, link.mirrors["ps:1"])
    assert link.mirrors["ps:1"].service.coordinator.held == [0]
    primary.finish(1)  # the held gradient is now a full set and is applied
    link.flush()
    _same(primary, link.mirrors["ps:1"])
    assert primary.coordinator.global_step == 2


def test_for_workers_that_prefetch_a_reply_waits_for_the_push_it_answers():
    """A prefetching worker sends its next push before it reads this reply, so it could not send this push again
    after a restore: the reply waits until the backup holds it (not only the one before)."""
    link = FakeLink()
    primary = _service(AsyncPolicy())
    _replicated(primary, link, own_push=True)
    first = primary.push_pull(PushPull(0, Ticket(0), _grads(primary, 0), 0.1, 1))
    assert not first.done()  # its own push is not at the backup yet
    link.flush()
    assert first.done()
    second = primary.push_pull(PushPull(0, first.value().pulled.ticket, _grads(primary, 1), 0.1, 2))
    assert not second.done()
    link.flush()
    assert second.done()
    _same(primary, link.mirrors["ps:1"])


def test_ssp_and_local_step_deltas_replicate():
    link = FakeLink()
    primary = _service(SSPPolicy(1), num_workers=2)
    _replicated(primary, link)
    for step in range(3):
        for w in (0, 1):
            primary.push(w, Ticket(primary.coordinator.global_step, gap=w), _grads(primary, 10 * step + w), None,
                         kind="delta")
    link.flush()
    _same(primary, link.mirrors["ps:1"])


def test_hash_tables_admissions_and_held_rows_replicate():
    """A hash table's sightings (a read admits ids) and a sync step's held rows reach the mirror."""
    spec = TableSpec("h", None, 2, torch.float32, 1, "hash", init_std=0.1, seed=3, admit_after=2)
    link = FakeLink()
    primary = _service(SyncPolicy(2, 2), 2, TableShards(0, [spec], SparseAdam(lr=0.1)))
    _replicated(primary, link)
    keys = (torch.tensor([5, 7, 11]),)
    for step in range(3):
        for w in (0, 1):
            primary.read_rows(RowRead(w, ("h",), keys))
            rows = RowPush(("h",), keys, (torch.full((3, 2), float(step + w)),))
            primary.push(w, Ticket(step), _grads(primary, step), 0.1, rows)
        link.flush()
    link.mirrors["ps:1"].wait_applied()
    mirror = link.mirrors["ps:1"].service
    _same(primary, mirror)
    # and the mirror goes on as the primary does: a fresh read admits the same new id with the same random row
    for number in (1, 2):
        new = RowRead(0, ("h",), (torch.tensor([99]),), number)
        assert torch.equal(primary.read_rows(new)[0], mirror.read_rows(new)[0])
    assert bool(primary.read_rows(new)[0].any())  # admitted on its second sighting
    sent_again = RowRead(0, ("h",), (torch.tensor([123]),), 2)  # number 2 was counted: no sighting now
    primary.read_rows(sent_again)
    primary.read_rows(RowRead(0, ("h",), (torch.tensor([123]),), 3))
    assert not bool(primary.read_rows(RowRead(0, ("h",), (torch.tensor([123]),), 3))[0].any())  # seen once only


def test_a_lost_backup_leaves_the_primary_unreplicated_until_it_is_seeded_again():
    link = FakeLink()
    primary = _service(AsyncPolicy())
    replica, said = _replicated(primary, link)
    del link.mirrors["ps:1"]  # the backup dies
    ticket = primary.pull(0).wait().ticket
    reply = primary.push_pull(PushPull(0, ticket, _grads(primary, 1), None, 1))
    link.restarted[1] = "ps:1:r1"
    link.mirrors["ps:1:r1"] = Mirror("model", 0)
    link.flush()  # the frame fails: the reply goes at once, and the watcher seeds the new incarnation
    assert reply.done() and "going on unreplicated" in said[0]
    _wait_seeding(replica, link, "ps:1:r1")  # the watcher thread seeds
    assert replica.backup == "ps:1:r1" and replica.backup_losses == 1
    link.flush()
    reply = primary.push_pull(PushPull(0, reply.wait().pulled.ticket, _grads(primary, 2), None, 2))
    link.flush()
    assert reply.done()
    _same(primary, link.mirrors["ps:1:r1"])


def test_a_primary_says_it_went_unreplicated_before_it_answers_without_its_backup():
    """A backup cut off while alive keeps a mirror that stopped early: the chief must not restore a lost primary from
    it. So the primary records that it goes on alone before a reply leaves without the backup, and takes it back
    once a new backup holds its seed."""
    link = FakeLink()
    primary = _service(AsyncPolicy())
    events = []
    replica, _ = _replicated(primary, link, mark_unreplicated=lambda on: events.append(("unreplicated", on)))
    first = primary.push_pull(PushPull(0, primary.pull(0).wait().ticket, _grads(primary, 1), None, 1))
    second = primary.push_pull(PushPull(0, first.wait().pulled.ticket, _grads(primary, 2), None, 2))
    assert not second.done()  # it waits for the backup to hold the first push
    second.add_done_callback(lambda _: events.append("reply"))
    del link.mirrors["ps:1"]
    link.restarted[1] = "ps:1:r1"
    link.mirrors["ps:1:r1"] = Mirror("model", 0)
    link.flush()  # the first push's frame fails
    assert events[:2] == [("unreplicated", True), "reply"]
    _wait_seeding(replica, link, "ps:1:r1")  # the watcher thread seeds
    link.flush()  # the seed is acknowledged
    assert events == [("unreplicated", True), "reply", ("unreplicated", False)]


def test_a_mirror_stands_for_a_lost_primary_only_when_that_incarnation_fed_it_throughout():
    whole = MirrorState(snapshot={"values": 1}, fed_by="ps:1:r1", seq=5)
    assert holds_all_it_answered(whole, "ps:1:r1", None) and holds_all_it_answered(whole, "ps:1:r1", "0")
    assert not holds_all_it_answered(whole, "ps:1:r1", "1")  # it went on without this backup
    assert not holds_all_it_answered(whole, "ps:1", None)  # seeded by a later incarnation than the lost one
    assert not holds_all_it_answered(MirrorState(None, "ps:1:r1", 5), "ps:1:r1", None)  # an op failed there
    assert not holds_all_it_answered(None, "ps:1:r1", None)  # the backup is gone too


def _lose_backup_then_wait(replica, link, primary, deadline_s=10.0):
    """Lose the backup under a push, and wait until the watcher is done: it seeded a new backup or gave up."""
    del link.mirrors["ps:1"]
    reply = primary.push_pull(PushPull(0, primary.pull(0).wait().ticket, _grads(primary, 1), None, 1))
    link.flush()
    deadline = time.monotonic() + deadline_s
    while replica._watching and time.monotonic() < deadline:
        time.sleep(0.01)
    return reply


def _restarts(link, answers):
    """A wait for the backup's restart that gives `answers` in turn: an error to raise, or the name of the
    incarnation that is back (its mirror then exists)."""

    def wait_for_restart(task, lost, cause):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        link.mirrors[answer] = Mirror("model", 0)
        return answer

    return wait_for_restart


def test_a_store_error_while_waiting_for_the_backup_is_retried_not_the_end_of_replication():
    """The wait for the backup's restart reads the cluster's store, which can fail for a moment (an etcd leader
    change, a connection reset): the watcher asks again until the backup is back, then seeds it."""
    link = FakeLink()
    primary = _service(AsyncPolicy())
    replica, said = _replicated(primary, link)
    replica.retry_every = 0.01
    answers = [RuntimeError("store unreachable"), ConnectionResetError("Connection reset by peer"), "ps:1:r1"]
    replica._wait_for_restart = _restarts(link, answers)
    reply = _lose_backup_then_wait(replica, link, primary)
    assert reply.done() and replica.backup == "ps:1:r1" and not answers
    assert sum("still waiting" in line for line in said) == 2
    link.flush()
    _same(primary, link.mirrors["ps:1:r1"])


@pytest.mark.parametrize("healed", [True, False])
def test_a_backup_not_restarted_in_time_is_offered_a_seed_again_on_a_new_connection(healed):
    """A backup whose calls failed but that is not restarted within the wait may live on, cut off from the primary
    (a network partition): the primary opens a new connection and seeds that same incarnation. Healed, it holds
    the part again; still cut off (or dead after all), that seed fails and the watch goes on to its restart."""
    link = FakeLink()
    primary = _service(AsyncPolicy())
    reconnected = []
    replica, said = _replicated(primary, link, reconnect=reconnected.append)
    answers = [ClusterTimeoutError("not back within 75 s"), "ps:1:r1"]
    replica._wait_for_restart = _restarts(link, answers)
    mirror = link.mirrors["ps:1"]
    _lose_backup_then_wait(replica, link, primary)
    deadline = time.monotonic() + 10
    while replica.backup != "ps:1" and time.monotonic() < deadline:  # the watcher thread seeds
        time.sleep(0.01)
    assert reconnected == ["ps:1"] and replica.backup == "ps:1"  # the seed to the same incarnation is on its way
    if healed:
        link.mirrors["ps:1"] = mirror
        link.flush()
        assert replica.backup == "ps:1" and answers == ["ps:1:r1"]
        _same(primary, mirror)
        return
    link.flush()  # the seed fails: the next watch waits for the restart
    _wait_seeding(replica, link, "ps:1:r1")
    link.flush()
    assert replica.backup == "ps:1:r1" and not answers
    _same(primary, link.mirrors["ps:1:r1"])


def test_a_backup_that_will_not_be_restarted_ends_the_watch_with_the_reason():
    link = FakeLink()
    primary = _service(AsyncPolicy())
    replica, said = _replicated(primary, link)

    def wait_for_restart(task, lost, cause):
        raise PeerLost("lost /job:ps/task:1, and it will not be restarted (0 of 0 restarts used)")

    replica._wait_for_restart = wait_for_restart
    reply = _lose_backup_then_wait(replica, link, primary)
    assert reply.done() and replica.backup is None and not replica._watching
    assert "will not be back" in said[-1] and "0 of 0 restarts used" in said[-1] and "stays unreplicated" in said[-1]


@pytest.mark.parametrize("lost_before_ack", [False, True])
def test_a_primary_restored_from_its_mirror_continues_exactly_as_the_unkilled_one(lost_before_ack):
    """The primary dies with one push forwarded (acked or not): a fresh service restored from the mirror, then
    given the pushes the mirror does not count, ends equal to a primary that never died."""
    reference = _service(SyncPolicy(2, 2), 2)
    link = FakeLink()
    primary = _service(SyncPolicy(2, 2), 2)
    _replicated(primary, link)
    pushes = [(w, Ticket(s), _grads(primary, 10 * s + w)) for s in range(3) for w in (0, 1)]
    for w, t, g in pushes[:3]:
        reference.push(w, t, g, 0.1)
        primary.push(w, t, g, 0.1)
    if lost_before_ack:
        link.queue.pop()  # the last push never reached the backup
    link.flush()
    restored = _service(SyncPolicy(2, 2), 2)
    _snapshot.install(restored, link.mirrors["ps:1"].state().snapshot)
    counted = restored.coordinator.pushes_by_worker[pushes[2][0]]
    assert counted == (1 if lost_before_ack else 2)
    for w, t, g in pushes[2 if lost_before_ack else 3:]:  # the worker pushes again what was not counted
        restored.push(w, t, g, 0.1)
    for w, t, g in pushes[3:]:
        reference.push(w, t, g, 0.1)
    _same(reference, restored)


class _OwnCall:
    """An op sent on a thread's own connection: the backup gets it, and acks, only when the thread reads the ack."""

    def __init__(self, link, frame):
        self.link, self.frame, self.value = link, frame, None

    def result(self):
        if self.value is None:
            self.value = self.link.mirrors["ps:1"].receive(pickle.loads(pickle.dumps(self.frame))).wait()
        return self.value


def test_a_thread_that_may_wait_sends_on_its_own_connection_and_reads_the_acks_itself():
    """A same-host link's thread: the first op goes by the messaging thread (opening a connection waits for the
    backup, never under the service's lock), later ones on the thread's own connection, whose acks it reads when
    it next delivers, all but the last one: the reply to a push waits only for the worker's previous push."""
    link = FakeLink()
    opened = []

    def direct(to):
        opened.append(to)
        return lambda frame: _OwnCall(link, frame)

    primary = _service(AsyncPolicy())
    replica = Replicator("model", 0, "ps:0", 1, primary._lock, lambda: _snapshot.take(primary), link.call,
                         lambda e: isinstance(e, Lost), link.wait_for_restart, lambda text: None, direct=direct)
    primary.replica = replica
    link.mirrors["ps:1"] = Mirror("model", 0)
    replica.seed("ps:1")
    link.flush()
    ticket = Ticket(0)
    for step in range(4):
        reply = primary.push_pull(PushPull(0, ticket, _grads(primary, step), 0.1, step + 1))
        if step == 0:
            assert len(link.queue) == 1 and opened == ["ps:1"]  # by the messaging thread; the connection opened after
            link.flush()
        assert reply.done()  # the previous push was acknowledged: read on this thread's connection
        ticket = reply.value().pulled.ticket
    assert not link.queue and replica.acked == replica.seq - 1  # the last push's ack is still unread
    assert primary.finish(0).done()  # a finish waits for every op: this thread reads every ack, its own included
    link.flush()
    _same(primary, link.mirrors["ps:1"])


def test_a_thread_that_settles_after_its_reply_holds_back_no_other_workers_reply():
    """Acks count in order. Worker 0's thread leaves its newest op's ack unread when it replies (reading it would make
    that reply wait a round trip); unread until its next op, it would hold back worker 1's reply to a later push.
    `settle`, which a link's thread runs once its reply is out, reads it while worker 0 computes."""
    link = FakeLink()
    primary = _service(AsyncPolicy(), num_workers=2)
    replica = Replicator("model", 0, "ps:0", 1, primary._lock, lambda: _snapshot.take(primary), link.call,
                         lambda e: isinstance(e, Lost), link.wait_for_restart, lambda text: None,
                         direct=lambda to: lambda frame: _OwnCall(link, frame))
    primary.replica = replica
    link.mirrors["ps:1"] = Mirror("model", 0)
    replica.seed("ps:1")
    link.flush()
    threads = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(2)]  # each worker's link thread

    def step(worker, s, settle):
        reply = primary.push_pull(PushPull(worker, Ticket(0), _grads(primary, s), 0.1, s + 1))
        if settle:
            replica.settle()
        return reply

    try:
        for worker in (0, 1):  # the first ops go by the messaging thread; each thread's own connection opens after
            threads[worker].submit(step, worker, 0, False).result()
        link.flush()
        for s, (worker, settle) in enumerate([(0, False), (1, False), (1, False)], start=1):
            threads[worker].submit(step, worker, s, settle).result()
        stuck = threads[1].submit(step, 1, 4, False).result()
        assert not stuck.done()  # worker 0's push 1, its thread's newest op, is unread: worker 1 waits for it
        threads[0].submit(replica.settle).result()
        assert stuck.done()  # worker 0's thread read it once its reply was out
        for s, worker in enumerate((0, 1, 1, 0, 0), start=5):  # settling after each reply, no worker waits on another
            assert threads[worker].submit(step, worker, s, True).result().done()
    finally:
        for t in threads:
            t.shutdown()


@pytest.mark.parametrize("replicas, num_ps, ok", [(1, 1, True), (2, 2, True), (2, 5, True), (2, 1, False),
                                                   (3, 4, False), (0, 2, False), (True, 2, False)])
def test_ps_replicas_are_one_or_two_with_enough_ps_tasks(replicas, num_ps, ok):
    if ok:
        assert check_ps_replicas(replicas, num_ps) == replicas
    else:
        with pytest.raises(ParameterServerError, match=rf"ps_replicas={replicas!r} with {num_ps} ps task"):
            check_ps_replicas(replicas, num_ps)


def test_with_a_lag_bound_replies_run_that_many_ops_ahead_of_the_backup_and_no_further():
    """Asynchronous replication: a reply waits only when the backup's acks are more than `max_lag` ops behind."""
    link = FakeLink()
    primary = _service(AsyncPolicy())
    replica, _ = _replicated(primary, link)  # the seed is op 1, acknowledged
    replica.max_lag = 3
    replies, ticket = [], Ticket(0)
    for step in range(4):
        replies.append(primary.push_pull(PushPull(0, ticket, _grads(primary, step), 0.1, step + 1)))
        ticket = replies[-1].wait().pulled.ticket if replies[-1].done() else ticket
    assert [r.done() for r in replies] == [True, True, True, False]  # ops 2-4 unacknowledged; op 5's reply waits
    assert replica.metrics()["lag"] == 4 and replica.metrics()["max_lag"] == 3
    link.flush(order=[0])  # the backup acknowledges op 2: op 5 is then 3 ahead
    assert replies[-1].done()
    link.flush()
    assert replica.metrics()["lag"] == 0
    _same(primary, link.mirrors["ps:1"])


@pytest.mark.parametrize("lag, replicas, mode, ok", [(0, 1, "sync", True), (0, 2, "sync", True), (16, 2, "async", True),
                                                     (16, 1, "async", False), (16, 2, "sync", False),
                                                     (16, 2, "ssp", False), (-1, 2, "async", False), (1.5, 2, "async", False)])
def test_a_replica_lag_needs_two_replicas_and_async_training(lag, replicas, mode, ok):
    if ok:
        assert check_replica_lag(lag, replicas, mode) == lag
    else:
        with pytest.raises(ParameterServerError, match=rf"ps_replica_lag={lag!r}"):
            check_replica_lag(lag, replicas, mode)


def test_restarts_that_never_served_do_not_cost_the_mirror():
    """A ps host cut off for longer than its restarts take: each restart fails at once, then one joins. The mirror
    its first incarnation fed still stands for the part; not when an incarnation since went on without it."""
    fed = MirrorState(snapshot={"values": 1}, fed_by="ps:0", seq=5)
    lost = [f"ps:0:r{k}" for k in range(17, 0, -1)] + ["ps:0"]  # the newest first
    assert stands_for_the_lost(fed, lost, lambda name: None)
    assert stands_for_the_lost(fed, lost, lambda name: "promoted" if name == "ps:0" else None)  # its backup stood in
    assert not stands_for_the_lost(fed, lost, lambda name: "1" if name == "ps:0:r5" else None)  # r5 served alone
    assert not stands_for_the_lost(MirrorState(snapshot={"values": 1}, fed_by="ps:1", seq=5), lost, lambda name: None)
    assert not stands_for_the_lost(None, lost, lambda name: None)
