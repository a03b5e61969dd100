"""What a ZeroMQ connection's monitor says about the task at its other end, as the errors callers get.

Every connection a task opens (an endpoint's peer socket, a thread's direct channel) is watched by a
monitor socket; a `ConnectionWatch` turns its events into `ConnectionLost` (the task's process ended, or its
host stopped answering heartbeats) or ClusterJoinError (the two tasks' credentials differ).

libzmq sends a monitor's events from its I/O thread with a blocking send: a monitor socket closed while
its socket still monitors (a garbage collector's order, or a context destroyed with both open) leaves the
next event, such as the disconnect of a task that just died, blocked for good, and with it every
connection of the process (no heartbeat answered, no handshake completed). So a monitored socket is
only ever closed by `close_monitored`, which stops the monitor first, and both are held here until then:
never garbage, the collector cannot close them in its own order (it finalizes a cycle's objects in any).
"""

from __future__ import annotations

import itertools
import threading
from typing import Dict, Optional

import zmq

from towerflow.cluster.calls.names import lost_task
from towerflow.errors import ClusterJoinError, ConnectionLost

WATCHED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_monitors = itertools.count(1)
_monitored: Dict[zmq.Socket, zmq.Socket] = {}  # socket -> its monitor, while the monitor is on
_monitored_lock = threading.Lock()


def peer_lost(message: str, to: str) -> ConnectionLost:
    """The error of a call whose task (call name `to`) is gone: its process ended, its host went away, or it
    never existed."""
    task, incarnation = lost_task(to)
    return ConnectionLost(message, task, incarnation)


def monitor(socket: zmq.Socket) -> zmq.Socket:
    """A PAIR socket receiving `socket`'s WATCHED events, on an address no other monitor of the process had.
    pyzmq's default address is named after the socket's descriptor number, and a socket monitored for every
    event that is garbage-collected instead of closed can keep that address bound for good (seen with pyzmq
    27.3 and libzmq 4.3.5): a later socket given the same number could then not be monitored."""
    address = f"inproc://towerflow-monitor-{next(_monitors)}"
    socket.monitor(address, WATCHED)
    pair = socket.context.socket(zmq.PAIR)
    # No queue limit: at libzmq's (2,000 events, 200 s of a dead task's reconnects) its I/O thread would block,
    # and every connection of the process with it, until the thread owning this monitor, maybe idle, read one.
    pair.rcvhwm = 0
    pair.connect(address)
    socket._monitor_socket = pair  # where pyzmq's disable_monitor looks
    with _monitored_lock:
        _monitored[socket] = pair
    return pair


def close_monitored(socket: zmq.Socket, pair: zmq.Socket) -> None:
    """Close `socket` and its monitor `pair`: the monitor stopped first (libzmq then sends it no more events)."""
    if not socket.closed:
        socket.disable_monitor()
    with _monitored_lock:
        _monitored.pop(socket, None)
    pair.close(0)
    socket.close(0)


def stop_monitors(context: zmq.Context) -> None:
    """Stop the monitor of every socket of `context` still open (another thread's channel), before the context
    is destroyed: its sockets are closed in no set order, a monitor maybe before its socket."""
    with _monitored_lock:
        mine = [s for s in _monitored if s.context is context]
        for socket in mine:
            del _monitored[socket]
    for socket in mine:
        if not socket.closed:
            socket.disable_monitor()


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
                return peer_lost(f"{self.to} at {self.address} accepted the connection of {self.me} but twice failed "
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
            return peer_lost(f"the connection from {self.me} to {self.to} at {self.address} closed: its process ended, "
                            "or its host stopped answering ZeroMQ's heartbeats", self.to)
        if event == zmq.EVENT_CONNECT_RETRIED and not self.is_up:
            if self._reconnect_expected:
                self._reconnect_expected = False
                return None
            return peer_lost(f"{self.me} cannot connect to {self.to} at {self.address}: nothing listens there any more "
                            "(its process ended)", self.to)
        return None


def unknown(to: str) -> ConnectionLost:
    return peer_lost(f"no task named {to!r} has joined the cluster (it was never started, or it was replaced by a "
                    "restarted incarnation)", to)
