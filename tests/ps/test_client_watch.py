"""A worker waiting on the ps learns of a ps task restarted under it, even when none of its own calls saw the
loss: in a sync round the chief waits on ps task 0 for a worker that is itself waiting for the chief to restore
ps task 1. Driven with a fake server: the store's incarnations are a dict the test changes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from towerflow.ps import plan_layout
from towerflow.ps.messages import PolicySpec
from towerflow.errors import PSTaskLost
from towerflow.ps.worker.client import PSClient

pytestmark = pytest.mark.timeout(30)


class FakeServer:
    """What the client asks of its server while it waits: heartbeats (all well) and each task's incarnation."""

    def __init__(self):
        self.names = {0: "ps:0", 1: "ps:1"}

    def call_name_of(self, job: str, index: int) -> str:
        return self.names[index]

    def peer_watch(self, serving=()):
        return lambda: None


def _client(server) -> PSClient:
    params = dict(torch.nn.Linear(3, 2).named_parameters())
    client = PSClient(server, "model", 0, True, torch.device("cpu"), PolicySpec("sync", 2), prefetch=False)
    client.attach(plan_layout(params, 2), params, torch.optim.SGD, {"lr": 0.1})
    return client


def test_a_wait_on_one_ps_task_ends_when_another_is_restarted():
    server = FakeServer()
    client = _client(server)
    never = torch.futures.Future()  # ps 0's sync round: it would answer once the other worker pushes
    threading.Timer(0.3, lambda: server.names.__setitem__(1, "ps:1:r1")).start()
    t0 = time.monotonic()
    with pytest.raises(PSTaskLost) as lost:
        client.wait(client.channels[0], never)
    assert lost.value.part == 1 and lost.value.name == "ps:1"  # the incarnation that is gone, for the recovery
    assert "restarted (now ps:1:r1)" in str(lost.value)
    assert time.monotonic() - t0 < 5


def test_a_wait_answered_in_time_is_not_disturbed_by_the_watch():
    server = FakeServer()
    client = _client(server)
    answer = torch.futures.Future()
    threading.Timer(1.5, lambda: answer.set_result("values")).start()  # past one watch round
    assert client.wait(client.channels[0], answer) == "values"


def test_after_the_recovery_follows_the_restart_the_watch_is_quiet_again():
    server = FakeServer()
    client = _client(server)
    server.names[1] = "ps:1:r1"
    client.follow_restarts()
    answer = torch.futures.Future()
    threading.Timer(1.5, lambda: answer.set_result(7)).start()
    assert client.wait(client.channels[1], answer) == 7
