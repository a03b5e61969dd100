"""ps/worker/linked.py: the worker's side of the same-host link, without processes."""

from __future__ import annotations

import os
import types

import torch

from towerflow.ps.worker import linked


def _channel():
    return types.SimpleNamespace(task=1, buffers=[[torch.zeros(1000), torch.zeros(10, dtype=torch.float64)]] * 2)


def test_an_offer_has_the_shapes_of_the_channel_buffers():
    link = linked.offer_for(_channel(), "/job:worker/task:0")
    try:
        assert link.offer.requests == link.offer.replies == ((1000, torch.float32), (10, torch.float64))
        assert [t.shape for t in link.requests[0]] == [torch.Size([1000]), torch.Size([10])]
    finally:
        link.close()


def test_no_room_in_shared_memory_says_why_and_falls_back_to_rpc(monkeypatch, capsys):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    assert linked.offer_for(_channel(), "/job:worker/task:0") is None
    err = capsys.readouterr().err
    assert "/job:worker/task:0: no shared-memory link to /job:ps/task:1" in err
    assert "--shm-size" in err and "TOWERFLOW_PS_LINK=zmq" in err


def test_a_link_is_wanted_only_between_tasks_named_on_one_host(monkeypatch):
    cluster = types.SimpleNamespace(task_address=lambda job, i: {("worker", 0): "hosta:1", ("ps", 0): "hosta:2",
                                                                  ("ps", 1): "hostb:2"}[(job, i)])
    assert linked.wanted(cluster, ("worker", 0), 0, "shm") and not linked.wanted(cluster, ("worker", 0), 1, "shm")
    assert not linked.wanted(cluster, ("worker", 0), 0, "zmq")  # TOWERFLOW_PS_LINK=zmq: never
