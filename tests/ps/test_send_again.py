"""A worker's side of a restore from a mirror (`Recovery._send_again`), against a fake client: which of its kept
pushes it sends again, and, with asynchronous replication, how many the restored ps lost for good."""

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

    def __init__(self, channels, replica_lag):
        self.channels, self.replica_lag, self.worker, self.pushes = channels, replica_lag, 0, 0
        self.server = types.SimpleNamespace(name="/job:worker/task:0")
        self.pushed_again, self.installed = [], None

    def _push_pull_call(self, ch, buffers, push):
        self.pushed_again.append((ch.task, push.clock))
        return ("push", ch.task, push.clock)

    def call(self, ch, endpoint, *args):
        return ("pull", ch.task)

    def wait(self, ch, call):
        pass

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
