"""What a ZeroMQ connection's monitor says about the task at its other end, as the errors callers get.

Every connection a task opens (an endpoint's peer socket, a thread's direct channel) is watched by a
monitor socket; its events become `PeerGone` (the task's process ended, or its host stopped
answering heartbeats) or ClusterJoinError (the two tasks' credentials differ).
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


def peer_failure(event: int, is_up: bool, me: str, to: str, address: str) -> Optional[BaseException]:
    """What a monitor `event` of a connection from `me` to `to` means for the calls on it: None (nothing), or
    the error that fails them: refused credentials, a closed connection, one that cannot be opened any more."""
    if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                 zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return ClusterJoinError(
            f"{to} at {address} refused the connection of {me}: the two tasks have different cluster tokens "
            "(TOWERFLOW_CLUSTER_TOKEN) or wire security settings (TOWERFLOW_WIRE_SECURITY). Give every task of the "
            "cluster the same ones.", task=to)
    if event == zmq.EVENT_DISCONNECTED:
        return PeerGone(f"the connection from {me} to {to} at {address} closed: its process ended, or its host "
                        "stopped answering ZeroMQ's heartbeats", to)
    if event == zmq.EVENT_CONNECT_RETRIED and not is_up:
        return PeerGone(f"{me} cannot connect to {to} at {address}: nothing listens there any more (its process "
                        "ended)", to)
    return None


def unknown(to: str) -> PeerGone:
    return PeerGone(f"no task named {to!r} has joined the cluster (it was never started, or it was replaced by a "
                    "restarted incarnation)", to)
