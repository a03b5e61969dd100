"""What a ZeroMQ connection's monitor says about the task at its other end, as the errors callers get.

Every connection a task opens (an endpoint's peer socket, a thread's direct channel) is watched by a
monitor socket; a `ConnectionWatch` turns its events into `PeerGone` (the task's process ended, or its
host stopped answering heartbeats) or ClusterJoinError (the two tasks' credentials differ).
"""

from __future__ import annotations

import itertools
from typing import Optional

import zmq

from towerflow.errors import ClusterJoinError

WATCHED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_monitors = itertools.count(1)


class PeerGone(RuntimeError):
    """Raised on a call whose task is gone: its process ended, its host went away, or it never existed."""

    def __init__(self, message: str, task: str = ""):
        super().__init__(message)
        self.task = task

    def __reduce__(self):
        return (type(self), (str(self), self.task))


def monitor(socket: zmq.Socket) -> zmq.Socket:
    """A PAIR socket receiving `socket`'s WATCHED events, on an address no other monitor of the process had.
    pyzmq's default address is named after the socket's descriptor number, and a socket monitored for every
    event that is garbage-collected instead of closed can keep that address bound for good (seen with pyzmq
    27.3 and libzmq 4.3.5): a later socket given the same number could then not be monitored."""
    return socket.get_monitor_socket(WATCHED, addr=f"inproc://towerflow-monitor-{next(_monitors)}")


class ConnectionWatch:
    """What one connection's monitor events mean for the calls on it: None (nothing yet), or the error that
    fails them (refused credentials, a closed connection, one that cannot be opened any more).

    A handshake that fails without detail (libzmq's HANDSHAKE_FAILED_NO_DETAIL) is ambiguous: the other task
    reset the connection (its process was ending) or did not answer within ZeroMQ's handshake time, or, with
    CURVE (`encrypted`), it could not decrypt our hello (another cluster token: PLAIN says that with
    HANDSHAKE_FAILED_AUTH). So the first one is let through to libzmq's reconnect, and the retry decides:
    nothing listening (CONNECT_RETRIED again) is an ended task, a second failed handshake is the verdict."""

    def __init__(self, me: str, to: str, address: str, encrypted: bool):
        self.me, self.to, self.address, self.encrypted = me, to, address, encrypted
        self.is_up = False  # a handshake succeeded: every later close is the task gone
        self._handshakes_failed = 0
        self._reconnect_expected = False  # the retry libzmq schedules after a failed handshake is not news

    def event(self, event: int) -> Optional[BaseException]:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.is_up = True
            self._handshakes_failed = 0
            return None
        refused = event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._handshakes_failed += 1
            self._reconnect_expected = True
            if self._handshakes_failed < 2:
                return None
            if not self.encrypted:
                return PeerGone(f"{self.to} at {self.address} accepted the connection of {self.me} but twice failed "
                                "its handshake: it closed the connection or did not answer within ZeroMQ's handshake "
                                "time (its process is ending, or stuck)", self.to)
            refused = True
        if refused:
            return ClusterJoinError(
                f"{self.to} at {self.address} refused the connection of {self.me}: the two tasks have different cluster "
                "tokens (TOWERFLOW_CLUSTER_TOKEN) or wire security settings (TOWERFLOW_WIRE_SECURITY). Give every task "
                "of the cluster the same ones.", task=self.to)
        if event == zmq.EVENT_DISCONNECTED:
            if not self.is_up and self._reconnect_expected:
                return None
            return PeerGone(f"the connection from {self.me} to {self.to} at {self.address} closed: its process ended, "
                            "or its host stopped answering ZeroMQ's heartbeats", self.to)
        if event == zmq.EVENT_CONNECT_RETRIED and not self.is_up:
            if self._reconnect_expected:
                self._reconnect_expected = False
                return None
            return PeerGone(f"{self.me} cannot connect to {self.to} at {self.address}: nothing listens there any more "
                            "(its process ended)", self.to)
        return None


def unknown(to: str) -> PeerGone:
    return PeerGone(f"no task named {to!r} has joined the cluster (it was never started, or it was replaced by a "
                    "restarted incarnation)", to)
