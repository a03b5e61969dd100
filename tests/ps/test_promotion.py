"""A backup promoted in place of a lost primary (`--ps-replicas 2`), piece by piece: the store key that decides
between the primary going on alone and its backup taking its place, the mirror that serves and then refuses the
lost incarnation's ops, the primary that learns it was replaced and stops, the worker that turns to the
backup when the lost task is not back in time, and the workers and restarted chief that find a part promoted
already."""

from __future__ import annotations

import collections
import types

import pytest
import torch

from towerflow.cluster.spec import ClusterSpec
from towerflow.errors import ClusterTimeoutError, ConnectionLost, ParameterServerError
from towerflow.ps.messages import PushPull, Ticket
from towerflow.ps.replication_messages import PROMOTED, move_key, part_key
from towerflow.ps.server.replication import snapshot as _snapshot
from towerflow.ps.server.replication.mirror import Mirror
from towerflow.ps.policies import AsyncPolicy, SyncPolicy
from towerflow.ps.server.replication.replicator import Replicator
from towerflow.ps.worker.client import ps_task_lost
from towerflow.ps.worker.recovery import Recovery
from tests.ps.test_send_again import _Client as _RecordingClient
from tests.ps.test_replication import FakeLink, _grads, _replicated, _same, _service


class FakeStore:
    """compare_set as TCPStore and EtcdStore do it: set when the value is `expected` (absent counts as ""), return
    the value held after; an absent key with a non-empty `expected` stays absent and `expected` comes back."""

    def __init__(self):
        self.values = {}

    def swap(self, key, expected, desired):
        held = self.values.get(key)
        if held is None:
            if expected == "":
                self.values[key] = desired
                return desired
            return expected
        if held == expected:
            self.values[key] = desired
        return self.values[key]


@pytest.mark.parametrize("start", [None, "0"])
def test_the_primary_going_on_alone_and_its_backup_taking_its_place_exclude_each_other(start):
    store = FakeStore()
    if start is not None:
        store.values["k"] = start
    assert move_key(store.swap, "k", "1", ("", "0")) == "1"  # the primary went on alone first
    assert move_key(store.swap, "k", PROMOTED, ("", "0")) == "1"  # so its mirror is not promoted
    assert move_key(store.swap, "k", "0", ("1",)) == "0"  # a new backup took its seed: replicated again
    assert move_key(store.swap, "k", PROMOTED, ("", "0")) == PROMOTED  # now the backup may take its place
    assert move_key(store.swap, "k", "1", ("", "0")) == PROMOTED  # and the primary may not answer alone
    assert move_key(store.swap, "k", "0", ("1",)) == PROMOTED  # promotion is final


def test_a_promoted_mirror_serves_the_part_as_the_primary_left_it_and_refuses_the_lost_primarys_ops():
    link = FakeLink()
    primary = _service(SyncPolicy(2, 2), 2)
    fenced, marks = [], []
    replica, said = _replicated(primary, link, mark_unreplicated=lambda on: marks.append(on) or False,
                                fenced=fenced.append)
    for w in (0, 1):
        primary.push(w, Ticket(0), _grads(primary, w), 0.1)
    link.flush()
    mirror = link.mirrors["ps:1"]
    assert mirror.promote("ps:0:r1") is None  # a mirror fed by another incarnation cannot stand for it
    served = mirror.promote("ps:0")
    _same(primary, served)  # the held sync round too
    assert mirror.metrics()["promoted"]
    primary.push(0, Ticket(1), _grads(primary, 7), 0.1)  # the old primary, alive but cut off, goes on
    link.flush()  # the mirror refuses the op: the primary tries to go on alone, finds the promotion, stops
    assert marks == [True] and len(fenced) == 1 and "promoted" in fenced[0] and "/job:ps/task:1" in fenced[0]
    assert served.coordinator.pushes_by_worker[0] == 1  # the refused op never reached the served part


def test_a_promoted_mirror_refuses_a_seed_from_the_incarnation_it_stands_in_for():
    """A primary that was only frozen (or a seed it sent before it was lost, read late) re-seeds its backup: that
    seed must not end the promotion, or the part would go back to a process the workers gave up (and the store
    would stop marking the task as stood in for while it is still silent)."""
    link = FakeLink()
    primary = _service(AsyncPolicy())
    _replicated(primary, link)
    mirror = link.mirrors["ps:1"]
    served = mirror.promote("ps:0")
    assert served is not None and mirror.stands_in_for("ps:0") and not mirror.stands_in_for("ps:0:r1")
    primary.replica.seed("ps:1")  # the frozen primary wakes and seeds anew
    link.flush()
    assert mirror.promoted and mirror.fed_by == "ps:0"


def test_a_primary_that_cannot_say_it_goes_on_alone_stops():
    """The store is out of reach: the backup may be promoted meanwhile, so answering without it could fork the part."""
    link = FakeLink()
    primary = _service(AsyncPolicy())
    fenced = []

    def unreachable(on):
        raise ConnectionError("the store did not answer")
    _replicated(primary, link, mark_unreplicated=unreachable, fenced=fenced.append)
    del link.mirrors["ps:1"]  # the backup is lost
    link.restarted[1] = "ps:1"
    primary.push_pull(PushPull(0, primary.pull(0).wait().ticket, _grads(primary, 1), None, 1))
    link.flush()
    assert len(fenced) == 1 and "the store did not answer" in fenced[0]


def test_a_retired_mirror_takes_a_new_incarnations_seed_and_its_ops():
    link = FakeLink()
    primary = _service(AsyncPolicy())
    _replicated(primary, link)
    mirror = link.mirrors["ps:1"]
    assert mirror.promote("ps:0") is not None and mirror.retire() and not mirror.retire()
    restarted = _service(AsyncPolicy())  # the chief put ps 0 back; its new incarnation seeds this mirror
    restarted.replica = Replicator("model", 0, "ps:0:r1", 1, restarted._lock, lambda: _snapshot.take(restarted),
                                   link.call, lambda e: False, link.wait_for_restart, lambda text: None)
    restarted.replica.seed("ps:1")
    restarted.push(0, Ticket(0), _grads(restarted, 3), 0.1)
    link.flush()
    assert mirror.fed_by == "ps:0:r1" and not mirror.promoted
    _same(restarted, mirror)


# ---- the worker's side


class _Channel:
    def __init__(self, task, counted, kept):
        self.task, self.pushes, self.to, self.via, self.key = task, counted, f"ps:{task}", None, None
        self.sent = collections.deque([(f"buffers {n}", PushPull(0, Ticket(n), [], None, n)) for n in kept], maxlen=2)

    def serve_from(self, via, key):
        self.via, self.key = via, key


class _Server:
    """ps task 0 is lost and its launcher does not bring it back within the promotion wait; with `restarts_used`
    at `max_restarts` it will not bring it back at all, and `beating` says whether the task lives on."""

    def __init__(self, stood_in=(), max_restarts=3, restarts_used=0, beating=False, num_ps=2):
        self.name, self.max_restarts, self.heartbeat_timeout, self.incarnation = "/job:worker/task:0", max_restarts, 15.0, 0
        self.cluster = ClusterSpec({"ps": [f"localhost:{2222 + i}" for i in range(num_ps)]})  # one host: 0, 1, 2, ...
        self.beats_watched = []
        self.membership = types.SimpleNamespace(
            join_timeout=60.0, stood_in=lambda: frozenset(stood_in), incarnation_of=lambda job, task: restarts_used,
            stood_in_by=lambda job, task: f"{job}:{task + 1}" if (job, task) in stood_in else None,
            will_be_restarted=lambda job, task: restarts_used < max_restarts,
            beats_on=lambda job, task, within: self.beats_watched.append((task, within)) or beating,
            beat_count=lambda job, task: 0)
        self.context = types.SimpleNamespace(ps=types.SimpleNamespace(promote_after=5.0))
        self.waited = []
        self.clock = [100.0]  # time.monotonic() of promotion.py, when a test puts it there

    def wait_for_restart(self, job, task, lost, cause, timeout=None, alive_ok=False, beats_before=None):
        # to the tenth of a second: a first wait gets what is left of promote_after since the recovery began, which
        # the real clock makes a few ms short on a busy machine
        self.waited.append((task, None if timeout is None else round(timeout, 1)))
        self.clock[0] += timeout or 0.0  # the wait runs its whole time: the launcher never brings the task back
        raise ClusterTimeoutError(f"{lost} was not back within {timeout} s", task=self.name, missing=[lost])

    def call_name_of(self, job, task):
        return f"ps:{task}"

    def wait_watching(self, future, serving=(), task=None):
        self.watched = task


class _Client(_RecordingClient):
    """test_send_again's recording client, with two replicated ps tasks, the first one lost."""

    def __init__(self, stood_in=(), num_ps=2, **server):
        super().__init__([_Channel(t, 10, [9, 10]) for t in range(num_ps)], replica_lag=0)
        self.server, self.ps_replicas, self.pushes = _Server(stood_in, num_ps=num_ps, **server), 2, 10
        self.is_chief, self.global_step, self.model_name = True, 20, "model"
        self.layout = types.SimpleNamespace(num_ps=num_ps)

    def follow_restarts(self):
        pass

    def rejoin(self, restarted, wait_open):
        assert (restarted, wait_open) == (False, False)
        self.channels[0].pushes = 9  # ps 0's backup lacks the last push

    def resend(self, ch, buffers, push):
        self.pushed_again.append((ch.task, ch.via, push.clock))
        return ("push", ch.task)


def _promote_answers(monkeypatch, asked):
    """The backup answers every `promote` with True (it serves the part); the calls are recorded in `asked`."""
    from towerflow.ps.worker import recovery as _recovery

    def call_async(to, endpoint, args):
        asked.append((to, endpoint.name, args))
        future = torch.futures.Future()
        future.set_result(True)
        return future
    monkeypatch.setattr(_recovery._calls, "call_async", call_async)


def test_a_lost_ps_not_back_in_time_is_served_by_its_backup_and_nothing_is_lost(monkeypatch):
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client()
    recovery = Recovery(client)
    monkeypatch.setattr(recovery, "restore_ps", lambda: pytest.fail("a promoted part was restored"))
    recovery.recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert client.server.waited == [(0, 5.0)]  # the promotion wait, then no other
    assert asked == [("ps:1", "promote", ("model", 0, "ps:0"))] and client.server.watched == ("ps", 1)
    assert (client.channels[0].via, client.channels[0].key) == ("ps:1", part_key("model", 0))
    assert client.pushed_again == [(0, "ps:1", 10)]  # the push the backup lacked, sent to it
    (record,) = recovery.recoveries
    assert record["promoted"] == [0] and record["steps_lost"] == 0 and not record["reconnected"]


def test_two_ps_tasks_lost_together_wait_for_their_restarts_at_once_not_one_after_the_other(monkeypatch):
    """ps 0 and ps 1 went down together (one host): the worker sees ps 1's loss only once ps 0's part is promoted,
    5 s later; ps 1's wait ends when ps 0's did, and both parts are served by their backups."""
    from towerflow.ps.worker import promotion as _promotion
    from towerflow.ps.worker import recovery as _recovery

    stood, asked = set(), []

    def call_async(to, endpoint, args):  # the backup serves the part, and stands in for its task from then on
        asked.append((to, args[1]))
        stood.add(("ps", args[1]))
        future = torch.futures.Future()
        future.set_result(True)
        return future
    monkeypatch.setattr(_recovery._calls, "call_async", call_async)

    class TwoLost(_Client):
        def rejoin(self, restarted, wait_open):
            if ("ps", 1) not in stood:
                raise ps_task_lost(1, "ps:1", "ps:1 is gone")
            super().rejoin(restarted, wait_open)

    client = TwoLost(stood_in=stood, num_ps=3)
    monkeypatch.setattr(_promotion.time, "monotonic", lambda: client.server.clock[0])
    recovery = Recovery(client)
    recovery.recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert client.server.waited == [(0, 5.0), (1, 0.0)]  # one promotion wait for both, not 5 s each
    assert set(asked) == {("ps:1", 0), ("ps:2", 1)}  # (ps 1 is asked again for part 0: it says it serves it)
    (record,) = recovery.recoveries
    assert record["promoted"] == [0, 1] and record["steps_lost"] == 0


@pytest.mark.parametrize("max_restarts, restarts_used", [(0, 0), (3, 3)])
def test_a_lost_ps_the_launcher_will_not_restart_is_served_by_its_backup_once_its_heartbeats_stop(
        monkeypatch, max_restarts, restarts_used):
    """No restarts left: no restart wait; once the task has not beaten for the promotion wait, its backup serves."""
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client(max_restarts=max_restarts, restarts_used=restarts_used)
    recovery = Recovery(client)
    recovery.recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert client.server.beats_watched == [(0, 5.0)] and client.server.waited == []
    assert asked == [("ps:1", "promote", ("model", 0, "ps:0"))]
    (record,) = recovery.recoveries
    assert record["promoted"] == [0] and record["steps_lost"] == 0


def test_a_lost_ps_out_of_restarts_that_beats_on_is_not_promoted(monkeypatch):
    """Its process lives (only a connection was lost): no promotion beside a primary that may still serve others;
    the usual wait decides (here: the launcher will not restart it, so the job ends naming it)."""
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client(max_restarts=0, beating=True)
    with pytest.raises(ClusterTimeoutError):
        Recovery(client).recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert asked == [] and client.server.waited == [(0, None)]


def test_a_backup_that_cannot_stand_for_the_lost_primary_leaves_the_usual_wait(monkeypatch):
    from towerflow.ps.worker import recovery as _recovery

    def refused(to, endpoint, args):
        future = torch.futures.Future()
        future.set_result(False)
        return future
    monkeypatch.setattr(_recovery._calls, "call_async", refused)
    client = _Client()
    with pytest.raises(ClusterTimeoutError):  # the fake's launcher never brings ps 0 back
        Recovery(client).recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert client.server.waited == [(0, 5.0), (0, None)] and client.channels[0].via is None


def test_a_mirror_never_seeded_is_never_promoted():
    assert Mirror("model", 0).promote("ps:0") is None



def test_a_part_its_backup_serves_already_is_called_there_without_the_promotion_wait(monkeypatch):
    """Another worker promoted ps 0's backup (the store says it stands in for ps 0): this worker, or a restarted one,
    turns to it at once instead of waiting for a restart that may never come."""
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client(stood_in={("ps", 0)})
    recovery = Recovery(client)
    recovery.recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert client.server.waited == []  # neither the promotion wait nor a restart's
    assert asked == [("ps:1", "promote", ("model", 0, "ps:0"))]
    assert (client.channels[0].via, client.channels[0].key) == ("ps:1", part_key("model", 0))
    (record,) = recovery.recoveries
    assert record["promoted"] == [0] and record["steps_lost"] == 0


def test_a_restarted_chief_asks_a_promoted_part_at_its_backup_and_restores_nothing(monkeypatch):
    """The chief is restarted while ps 0's part is served by its backup and ps 0 is not back (its host lost for
    good): it asks the backup whether it holds the part, finds every part held, and connects as usual: nothing
    is restored, nothing waits for ps 0."""
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client(stood_in={("ps", 0)})
    client.server.incarnation = 1
    asked_holds = []

    def on_all(endpoint):
        asked_holds.append([ch.via or ch.to for ch in client.channels])
        if client.channels[0].via is None:
            raise ps_task_lost(0, "ps:0", "the connection to ps:0 failed its handshake")
        return [True, True]
    client.on_all = on_all
    client.connect = lambda: "connected"
    recovery = Recovery(client)
    monkeypatch.setattr(recovery, "restore_ps", lambda: pytest.fail("a part held by its backup was restored"))
    assert recovery.connect() == "connected"
    assert asked_holds == [["ps:0", "ps:1"], ["ps:1", "ps:1"]] and client.server.waited == []
    assert asked == [("ps:1", "promote", ("model", 0, "ps:0"))] and recovery.lost_with_chief == []


def test_a_promoted_part_whose_backup_is_lost_too_goes_on_to_the_next_ps_task(monkeypatch):
    """Three ps tasks: ps 0's part is served by ps 1 (promoted), which fed a mirror of it to ps 2; ps 1 is lost too,
    so ps 2 serves the part in place of ps 1, at once (no wait for ps 0, which may never come back)."""
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client(stood_in={("ps", 0)}, num_ps=3)
    client.channels[0].serve_from("ps:1", part_key("model", 0))
    recovery = Recovery(client)
    recovery.recover(ps_task_lost(0, "ps:1", "the connection to ps:1 closed"))
    assert asked == [("ps:2", "promote", ("model", 0, "ps:1"))] and client.server.waited == []
    assert (client.channels[0].via, client.channels[0].key) == ("ps:2", part_key("model", 0))
    (record,) = recovery.recoveries
    assert record["promoted"] == [0] and record["steps_lost"] == 0


def test_with_two_ps_tasks_a_promoted_part_whose_backup_is_lost_waits_for_its_own_task(monkeypatch):
    """No third task holds a mirror of it: the part's own task is waited for, as without replicas (here the fake
    launcher never brings it back, and the wait says so)."""
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client(num_ps=2)
    client.channels[0].serve_from("ps:1", part_key("model", 0))
    with pytest.raises(ClusterTimeoutError):
        Recovery(client).recover(ps_task_lost(0, "ps:1", "the connection to ps:1 closed"))
    assert asked == [] and client.server.waited == [(0, None)]


def test_a_promoted_part_whose_backup_is_lost_with_no_mirror_left_and_no_restart_ends_the_job_saying_so(monkeypatch):
    asked = []
    _promote_answers(monkeypatch, asked)
    client = _Client(num_ps=2, max_restarts=0)
    client.channels[0].serve_from("ps:1", part_key("model", 0))
    with pytest.raises(ParameterServerError) as e:
        Recovery(client).recover(ps_task_lost(0, "ps:1", "the connection to ps:1 closed"))
    assert "/job:ps/task:0's part is lost" in str(e.value) and "ps:1, the backup that served its part" in str(e.value)
    assert "Restart the job from the newest checkpoint" in str(e.value) and asked == []


def test_a_promoted_backup_that_beats_on_is_connected_to_again_not_replaced(monkeypatch):
    """Only the connection to the task serving the part was lost (its heartbeats go on): no promotion beside a
    backup that may still answer others; the worker connects to it again and goes on there."""
    from towerflow.ps.worker import recovery as _recovery

    asked, reconnected = [], []
    _promote_answers(monkeypatch, asked)
    monkeypatch.setattr(_recovery._calls, "reconnect", reconnected.append)
    client = _Client(stood_in={("ps", 0)}, num_ps=3, beating=True)
    client.channels[0].serve_from("ps:1", part_key("model", 0))
    Recovery(client).recover(ps_task_lost(0, "ps:1", "the connection to ps:1 closed"))
    assert asked == [] and reconnected == ["ps:1"] and client.server.beats_watched == [(1, 5.0)]
    assert client.channels[0].via == "ps:1"


def _promote_answers_by_task(monkeypatch, asked, answers):
    """Each ps task answers `promote` as `answers` says by its call name: True (it serves the part), False (its mirror
    cannot stand for the one it replaces), or an exception (it is lost during the call); a callable is asked for
    the answer as the call is made. The calls are recorded in `asked`."""
    from towerflow.ps.worker import recovery as _recovery

    def call_async(to, endpoint, args):
        asked.append((to, args))
        answer = answers[to]() if callable(answers[to]) else answers[to]
        future = torch.futures.Future()
        future.set_exception(answer) if isinstance(answer, Exception) else future.set_result(answer)
        return future
    monkeypatch.setattr(_recovery._calls, "call_async", call_async)


def _stand_ins(client, stands):
    """The store's stand-in marks as `stands` holds them at each look: a part's task -> who serves it (a call name)."""
    client.server.membership.stood_in = lambda: frozenset(("ps", task) for task in stands)
    client.server.membership.stood_in_by = lambda job, task: stands.get(task)


def _recovery_saying(client, said):
    recovery = Recovery(client)
    recovery._say = said.append
    return recovery


def _lost(name):
    return ConnectionLost(f"the connection to {name} closed", task=name)


@pytest.mark.parametrize("max_restarts, waited", [(3, [(0, 5.0)]), (0, [])])
def test_a_backup_lost_while_asked_to_serve_leaves_the_part_where_another_worker_promoted_it_onward(
        monkeypatch, max_restarts, waited):
    """Three ps tasks; ps 0 is lost for good. As this worker asks ps 1 to serve ps 0's part, ps 1 is lost too, and
    another worker, for which ps 1 served the part just before, has ps 2 serve it meanwhile: this worker calls the
    part at ps 2 and goes on, instead of waiting for ps 0, which will never be back."""
    stands, asked, said = {}, [], []

    def lost_as_another_worker_promotes_onward():
        stands[0] = "ps:2"
        return _lost("ps:1")
    _promote_answers_by_task(monkeypatch, asked, {"ps:1": lost_as_another_worker_promotes_onward, "ps:2": True})
    client = _Client(num_ps=3, max_restarts=max_restarts)
    _stand_ins(client, stands)
    recovery = _recovery_saying(client, said)
    recovery.recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert asked == [("ps:1", ("model", 0, "ps:0")), ("ps:2", ("model", 0, "ps:0"))]
    assert client.server.waited == waited  # the promotion wait, if any, and no wait for ps 0's restart after it
    assert (client.channels[0].via, client.channels[0].key) == ("ps:2", part_key("model", 0))
    assert client.pushed_again == [(0, "ps:2", 10)]  # the push the part lacked, sent to ps 2
    (record,) = recovery.recoveries
    assert record["promoted"] == [0] and record["steps_lost"] == 0
    assert said[-1].startswith("/job:ps/task:0 and then ps:1, the backup that served its part, were lost: its part is "
                               "served by its backup ps:2 (promoted); going on at global step 20; lost: nothing")


@pytest.mark.parametrize("stands, waited", [({0: "ps:1"}, []), ({}, [(0, 5.0)])])
def test_a_backup_lost_while_asked_to_serve_before_anyone_promoted_onward_is_passed_for_the_next_ps_task(
        monkeypatch, stands, waited):
    """ps 1, which stands in for ps 0 (another worker had it promoted) or is only its backup yet, is lost as this worker
    asks it for ps 0's part, and no other task stands in yet: this worker has ps 2 serve the part in place of ps 1,
    from the mirror ps 1 fed it once promoted, as when the task that served the part is lost."""
    asked, said = [], []
    _promote_answers_by_task(monkeypatch, asked, {"ps:1": _lost("ps:1"), "ps:2": True})
    client = _Client(num_ps=3)
    _stand_ins(client, dict(stands))
    recovery = _recovery_saying(client, said)
    recovery.recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert asked == [("ps:1", ("model", 0, "ps:0")), ("ps:2", ("model", 0, "ps:1"))]
    assert client.server.beats_watched == [(1, 5.0)]  # ps 1 was gone, not only cut off from this worker
    assert client.server.waited == waited and client.channels[0].via == "ps:2"
    assert said[-1].startswith("/job:ps/task:0 and then ps:1, the backup that served its part, were lost: its part is "
                               "served by its backup ps:2 (promoted)")


def test_a_backup_cut_off_while_asked_to_serve_is_not_passed(monkeypatch):
    """The call to ps 1 failed but its heartbeats go on (only the connection was lost): ps 2 is not promoted beside a
    task that may still serve the others; the usual wait decides (the fake launcher never brings ps 0 back)."""
    asked = []
    _promote_answers_by_task(monkeypatch, asked, {"ps:1": _lost("ps:1"), "ps:2": True})
    client = _Client(num_ps=3, beating=True)
    _stand_ins(client, {0: "ps:1"})
    with pytest.raises(ClusterTimeoutError):
        Recovery(client).recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert [to for to, _ in asked] == ["ps:1", "ps:1"] and client.channels[0].via is None


@pytest.mark.parametrize("ps2, lost_too", [
    (False, "ps:1, asked to serve its part in its place, was lost too"),
    (_lost("ps:2"), "ps:1, ps:2, asked to serve its part in its place, were lost too")])
def test_a_part_that_no_ps_task_left_can_serve_and_whose_task_will_not_be_restarted_ends_the_job_saying_so(
        monkeypatch, ps2, lost_too):
    """ps 0 will not be restarted; ps 1, which stands in for it, is lost as this worker asks it, and ps 2 holds no
    mirror fed by ps 1 (it refuses), or is lost too: the job ends naming the part lost, instead of waiting."""
    asked = []
    _promote_answers_by_task(monkeypatch, asked, {"ps:1": _lost("ps:1"), "ps:2": ps2})
    client = _Client(num_ps=3, max_restarts=0)
    _stand_ins(client, {0: "ps:1"})
    with pytest.raises(ParameterServerError) as e:
        Recovery(client).recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert str(e.value).startswith(f"/job:ps/task:0's part is lost: that task will not be restarted (no restarts left) "
                                   f"and {lost_too}")
    assert "Restart the job from the newest checkpoint" in str(e.value)
    assert [to for to, _ in asked].count("ps:1") == 1 and client.server.waited == []  # a lost task is asked once


def test_a_part_that_no_ps_task_left_can_serve_waits_for_its_task_when_that_will_be_restarted(monkeypatch):
    """As above, with restarts left: the part's own task is waited for, as without replicas (the chief then restores
    it); here the fake launcher never brings it back, and the wait says so."""
    asked = []
    _promote_answers_by_task(monkeypatch, asked, {"ps:1": _lost("ps:1"), "ps:2": False})
    client = _Client(num_ps=3)
    _stand_ins(client, {0: "ps:1"})
    with pytest.raises(ClusterTimeoutError):
        Recovery(client).recover(ps_task_lost(0, "ps:0", "ps:0 is gone"))
    assert client.server.waited == [(0, 5.0), (0, None)] and client.channels[0].via is None
