"""A launch's ports stay its own from the moment they are chosen until the launch ends."""

from __future__ import annotations

import errno
import socket

import pytest

from towerflow.cluster.store import c10d
from towerflow.launch.local import plan_local
from towerflow.cluster.ports import LOOPBACK, PortReservation


def _plain_bind_refused(port: int) -> bool:
    """What another launch choosing ports, or any program binding without SO_REUSEADDR, would meet."""
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE, e
            return True
        return False


def test_a_held_port_is_refused_to_others_but_its_task_can_listen_on_it_again_after_a_restart():
    with PortReservation(2) as held:
        port = held.ports[0]
        assert len(set(held.ports)) == 2 and _plain_bind_refused(port)
        task = c10d.listen(LOOPBACK, port)  # the task comes up: it binds and serves
        with socket.create_connection((LOOPBACK, port), timeout=5), task.accept()[0]:
            pass
        with pytest.raises(OSError) as second:  # a second live listener is still refused (a doubled task)
            c10d.listen(LOOPBACK, port)
        assert second.value.errno == errno.EADDRINUSE
        task.close()  # the task dies: its port is still held for it, not handed to whoever asks next
        assert _plain_bind_refused(port)
        c10d.listen(LOOPBACK, port).close()  # the restarted task gets it back


def test_the_kernel_does_not_hand_a_held_port_to_someone_asking_for_any_free_port():
    with PortReservation(1) as held:
        others = [socket.socket() for _ in range(300)]
        try:
            for s in others:
                s.bind((LOOPBACK, 0))
            assert held.ports[0] not in {s.getsockname()[1] for s in others}
        finally:
            for s in others:
                s.close()


def test_a_local_plan_holds_every_port_it_hands_out_until_it_is_released():
    plan = plan_local(["train.py"], ps=1, workers=2)
    ports = [int(a.rsplit(":", 1)[1]) for a in plan.cluster.as_dict()["ps"] + plan.cluster.as_dict()["worker"]]
    ports.append(int(plan.store_address.rsplit(":", 1)[1]))
    try:
        assert all(_plain_bind_refused(p) for p in ports)
    finally:
        plan.release()
    assert not any(_plain_bind_refused(p) for p in ports)
