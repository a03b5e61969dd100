"""A worker's side of a restore from a mirror (`Recovery._send_again`), against a fake client: which of its kept
pushes it sends again, and, with asynchronous replication, how many the restored ps lost for good; and the same
sending again after a connection lost to a ps task that lived on (nothing restored)."""

from __future__ import annotations

import collections
import types

import pytest

from towerflow.errors import ParameterServerError
from towerflow.ps.messages import PushPull, Ticket
from towerflow.ps.worker.recovery import Recovery


class _Channel:
    def __init__(self, task, counted, kept):
        self.task, self.pushes = task, counted  # what the restored ps counts of this worker's pushes
        self.sent = collections.deque([(f"buffers {n}", PushPull(0, Ticket(n), [], None, n)) for n in kept], maxlen=2)


class _Client:
    """Records what the recovery sends: pushes again (by their clock), and the pulls of the last round."""

    def __init__(self, channels, replica_lag, mode="async"):
        self.channels, self.replica_lag, self.worker, self.pushes = channels, replica_lag, 0, 0
        self.ps_replicas = 1
        self.policy = types.SimpleNamespace(mode=mode)
        self.server = types.SimpleNamespace(name="/job:worker/task:0")
        self.pushed_again, self.installed, self.events = [], None, []

    def keep_clock(self, pushes):
        self.pushes = max(self.pushes, pushes)

    def mark_opened(self):
        self.opened = True

    def resend(self, ch, buffers, push):
        self.pushed_again.append((ch.task, push.clock))
        self.events.append(("push", ch.task, push.ticket.step))
        return ("push", ch.task, push.clock)

    def call(self, ch, endpoint, *args):
        self.events.append(("pull", ch.task, args[-1]))  # (worker, clock, after_step)
        return ("pull", ch.task)

    def wait(self, ch, call):
        self.events.append(("waited", *call))

    def install(self, calls):
        self.installed = calls


def test_a_ps_restored_without_the_workers_last_pushes_gets_them_again_oldest_first():
    client = _Client([_Channel(0, 8, [9, 10]), _Channel(1, 10, [9, 10])], replica_lag=0)
    assert Recovery(client)._send_again({0: 10, 1: 10}, clock=10) == 0
    assert client.pushed_again == [(0, 9), (0, 10)]
    assert client.installed == [("push", 0, 10), ("pull", 1)]  # the untouched ps answers the step's pull
    assert [p.clock for _, p in client.channels[0].sent] == [9, 10]  # what is kept does not change


def test_more_missing_than_kept_is_an_error_with_synchronous_replication():
    client = _Client([_Channel(0, 5, [9, 10])], replica_lag=0)
    with pytest.raises(ParameterServerError, match="5 pushes of /job:worker/task:0 behind, and this worker keeps its last 2"):
        Recovery(client)._send_again({0: 10}, clock=10)


def test_with_a_replica_lag_the_pushes_beyond_those_kept_are_counted_lost_and_training_goes_on():
    client = _Client([_Channel(0, 5, [9, 10]), _Channel(1, 10, [9, 10])], replica_lag=16)
    assert Recovery(client)._send_again({0: 10, 1: 10}, clock=10) == 3  # pushes 6, 7 and 8 are gone
    assert client.pushed_again == [(0, 9), (0, 10)]
    assert client.installed == [("push", 0, 10), ("pull", 1)]
    assert client.pushes == 10


def test_sync_a_push_sent_again_waits_until_its_ps_task_reaches_the_pushs_step():
    """Other workers send their own lacking pushes again in no set order: a push of step 10 sent before another
    worker's push of step 9 completes round 9 would be refused as ahead of the ps. So each push sent again first
    waits for a pull that returns once its ps task reaches the push's step."""
    client = _Client([_Channel(0, 8, [9, 10]), _Channel(1, 9, [9, 10])], replica_lag=0, mode="sync")
    Recovery(client)._send_again({0: 10, 1: 10}, clock=10)
    assert client.events == [
        ("pull", 0, 9), ("waited", "pull", 0),  # round 1: ps 0 lacks push 9 (ps 1 lacks only push 10)
        ("push", 0, 9), ("waited", "push", 0, 9),
        ("pull", 0, 10), ("pull", 1, 10), ("waited", "pull", 0), ("waited", "pull", 1),  # round 2, both
        ("push", 0, 10), ("push", 1, 10),
    ]


class _Server:
    """A ps task that lives on: its incarnation keeps beating, so the wait for its restart returns its own name."""

    def __init__(self):
        self.name, self.max_restarts, self.heartbeat_timeout = "/job:worker/task:0", 3, 15.0
        self.membership = types.SimpleNamespace(join_timeout=60.0)
        self.waited = []

    def wait_for_restart(self, job, task, lost, cause, alive_ok=False):
        self.waited.append((task, alive_ok))
        return lost

    def call_name_of(self, job, task):
        return f"ps:{task}"


def test_a_connection_lost_to_a_ps_that_lives_on_is_opened_again_and_nothing_is_restored(monkeypatch):
    """The chief's connection to ps 0 closed while ps 0 went on (its heartbeats say so): no restart will come, so the
    worker connects again, learns what ps 0 counted, sends again the push it lacks, and no ps task is restored."""
    from towerflow.ps.worker import recovery as _recovery
    from towerflow.ps.worker.client import ps_task_lost

    reconnected = []
    monkeypatch.setattr(_recovery._calls, "reconnect", reconnected.append)
    client = _Client([_Channel(0, 10, [9, 10]), _Channel(1, 10, [9, 10])], replica_lag=0)
    client.server, client.is_chief, client.global_step, client.pushes = _Server(), True, 20, 10
    counted = {0: 9, 1: 10}  # ps 0 never got the step's push
    client.follow_restarts = lambda: None
    client.rejoin = lambda restarted, wait_open: [setattr(ch, "pushes", counted[ch.task]) for ch in client.channels]
    recovery = Recovery(client)
    monkeypatch.setattr(recovery, "restore_ps", lambda: pytest.fail("a live ps task was restored"))
    recovery.recover(ps_task_lost(0, "ps:0", "the connection from worker:0 to ps:0 closed"))
    assert reconnected == ["ps:0"] and client.server.waited == [(0, True)]
    assert client.pushed_again == [(0, 10)]
    (record,) = recovery.recoveries
    assert record["reconnected"] and record["steps_lost"] == 0 and record["pushes_lost"] == 0


def test_a_ps_that_lives_on_but_stays_out_of_reach_ends_the_wait_with_the_reason(monkeypatch):
    import time

    from towerflow.ps.worker import recovery as _recovery
    from towerflow.ps.worker.client import ps_task_lost

    monkeypatch.setattr(_recovery._calls, "reconnect", lambda name: None)
    client = _Client([_Channel(0, 10, [9, 10])], replica_lag=0)
    client.server = _Server()
    gone = ps_task_lost(0, "ps:0", "the connection from worker:0 to ps:0 closed")
    with pytest.raises(ParameterServerError, match=r"cannot reach /job:ps/task:0 \(ps:0\), which is still running"):
        Recovery(client)._connect_again([gone], seen=time.monotonic() - 100)


def test_a_restore_cut_short_by_another_loss_runs_again_from_the_checkpoint_never_from_a_mirror(monkeypatch):
    """Every replica of a part was lost, so the chief puts every ps task back to the checkpoint; another task is
    lost after the first part went out. The restore that runs again once it is back must send the checkpoint again:
    the new loss's mirror holds a state of another step than the parts already sent."""
    from towerflow.ps.worker import recovery as _recovery
    from towerflow.errors import PSTaskLost
    from towerflow.ps.worker.client import ps_task_lost

    asked_mirrors = []
    monkeypatch.setattr(_recovery.from_mirrors, "restore", lambda client, publish: asked_mirrors.append(1) or (
        None if len(asked_mirrors) == 1 else {1: "/job:ps/task:0"}))
    client = _Client([_Channel(0, 10, [9, 10]), _Channel(1, 10, [9, 10])], replica_lag=0)
    client.ps_replicas, client.model_name, client.opened = 2, "model", False
    client.policy = types.SimpleNamespace(mode="async", num_workers=1)
    client.finished_key = lambda worker: f"finished/{worker}"
    for ch in client.channels:
        ch.to = f"ps:{ch.task}"
    client.server = types.SimpleNamespace(name="/job:worker/task:0", lookup=lambda key: None,
                                          publish=lambda key, value: None)
    sent = []

    def create(ch, part, finished, open_now, restored_for):
        sent.append(ch.task)
        if sent == [0, 1]:  # ps task 1 lost as its part went out
            raise ps_task_lost(1, "ps:1", "killed")
        return ("create", ch.task)

    client.create = create
    recovery = Recovery(client)
    recovery.restore_source = lambda: (20, "ckpt-0000000020.pt", {"ps": {0: "part 0", 1: "part 1"}})
    with pytest.raises(PSTaskLost):
        recovery.restore_ps()
    assert recovery.restore_ps() == "ckpt-0000000020.pt"  # again, once ps task 1 is back: the checkpoint again
    assert asked_mirrors == [1] and sent == [0, 1, 0, 1]
