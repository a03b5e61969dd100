"""How a connection's monitor events become the error its calls fail with: a task that ended (ConnectionLost,
so that the caller waits for its restart) or one with other credentials (ClusterJoinError, a setup
mistake to fix). The event orders are the ones libzmq 4.3 emits (tests/cluster/test_messaging.py meets
the credential cases on real sockets)."""

from __future__ import annotations

import pytest
import zmq

from towerflow.cluster.calls.connection_events import ConnectionWatch
from towerflow.errors import ConnectionLost
from towerflow.errors import ClusterJoinError

CONNECTED = [zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECTED]
NO_DETAIL = [zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED]


def _verdict(events, encrypted):
    """The first error the events give, and after how many of them (None, len(events) when none)."""
    watch = ConnectionWatch("worker:0", "ps:0", "tcp://127.0.0.1:5000", encrypted)
    for i, event in enumerate(events, 1):
        error = watch.event(event)
        if error is not None:
            return error, i
    return None, len(events)


@pytest.mark.parametrize("encrypted", [False, True])
def test_a_task_ending_during_the_handshake_is_gone_not_a_credentials_mistake(encrypted):
    # it reset the connection mid-handshake, then nothing listens at its address
    events = CONNECTED + NO_DETAIL + [zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECT_RETRIED]
    error, at = _verdict(events, encrypted)
    assert isinstance(error, ConnectionLost) and "nothing listens there any more" in str(error)
    assert at == len(events)


def test_another_curve_key_is_refused_at_the_second_failed_handshake():
    events = CONNECTED + NO_DETAIL + CONNECTED + [zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL]
    error, at = _verdict(events, encrypted=True)
    assert isinstance(error, ClusterJoinError) and "different cluster tokens" in str(error)
    assert at == len(events)


def test_a_task_that_twice_fails_a_plain_handshake_is_gone_not_refusing():
    # PLAIN says "wrong password" with HANDSHAKE_FAILED_AUTH; without detail the task closed it or was silent
    events = CONNECTED + NO_DETAIL + CONNECTED + [zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL]
    error, _ = _verdict(events, encrypted=False)
    assert isinstance(error, ConnectionLost) and "twice failed its handshake" in str(error)


@pytest.mark.parametrize("event", [zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL])
def test_a_refused_handshake_is_a_credentials_mistake_at_once(event):
    error, at = _verdict(CONNECTED + [event], encrypted=False)
    assert isinstance(error, ClusterJoinError) and at == 3


def test_a_connection_that_was_up_and_closed_is_the_task_gone():
    error, _ = _verdict(CONNECTED + [zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED], encrypted=True)
    assert isinstance(error, ConnectionLost) and "closed" in str(error)


def test_nothing_listening_from_the_start_is_the_task_gone():
    error, at = _verdict([zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECT_RETRIED], encrypted=False)
    assert isinstance(error, ConnectionLost) and at == 2


def test_a_handshake_that_failed_once_then_succeeded_is_fine():
    events = CONNECTED + NO_DETAIL + CONNECTED + [zmq.EVENT_HANDSHAKE_SUCCEEDED]
    assert _verdict(events, encrypted=True) == (None, len(events))
