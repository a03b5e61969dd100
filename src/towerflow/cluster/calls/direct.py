"""A connection one thread owns to one task, for a hot loop of calls: sent and read in that thread.

An `Endpoint` call crosses two thread hand-offs on the caller's side (to the socket thread and
back), each a wake-up of another Python thread; a parameter-server step pays them every step.
A `DirectChannel` is a DEALER socket of its own that the calling thread sends on and reads its
reply from while it waits (no reader thread, no hand-off: one wake-up per reply), as the
same-host shared-memory link does. The called task serves it like any other connection. A reply
is awaited in a blocking read, as a bare pyzmq client would (a poll of the socket and its monitor
before each read cost a tenth of a small call); after each 0.2 s without one, the socket's
monitor is read, so a closed, refused or silent connection fails the call as the endpoint does
(`ConnectionLost`, ClusterJoinError), and `idle()` runs once a second (the heartbeat watch).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Dict, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from towerflow.cluster.calls import wire
from towerflow.cluster.calls.connection_events import ConnectionWatch, close_monitored, peer_lost, monitor

_WATCH_EVERY_MS = 1000
_IDLE_EVERY_S = _WATCH_EVERY_MS / 1000
_LOOK_EVERY_MS = 200  # how long a read blocks before the monitor is looked at (a lost peer shows within this)


class DirectChannel:
    """Calls from one thread to task `to` at `address`, over a socket only that thread touches."""

    def __init__(self, context: zmq.Context, me: str, to: str, address: str, configure: Callable[[zmq.Socket], None],
                 watch: ConnectionWatch):
        self.me, self.to, self.address = me, to, address
        self._socket = context.socket(zmq.DEALER)
        configure(self._socket)
        self._monitor = monitor(self._socket)
        self._socket.connect(address)
        self._socket.rcvtimeo = _LOOK_EVERY_MS
        self._send_poller = zmq.Poller()  # while a send waits for a connection to queue on
        self._send_poller.register(self._socket, zmq.POLLOUT)
        self._send_poller.register(self._monitor, zmq.POLLIN)
        self._ids = itertools.count(1)
        self._early: Dict[int, list] = {}  # replies read while waiting for another call's
        self._watch = watch
        self._failure: Optional[BaseException] = None

    def call(self, fn: Callable, *args: Any) -> "DirectCall":
        """Send fn(*args) to the task; the reply is read by `DirectCall.result`."""
        if self._failure is not None:
            raise self._failure
        call_id = next(self._ids)
        frames = wire.encode(call_id, wire.Call(fn, args))
        while True:
            try:
                self._socket.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return DirectCall(self, call_id)
            except zmq.Again:  # no connection to queue on yet (being made, or refused): wait, watching the monitor
                ready = dict(self._send_poller.poll(_WATCH_EVERY_MS))
                if self._monitor in ready:
                    self._event(recv_monitor_message(self._monitor)["event"])
                if self._failure is not None:
                    raise self._failure

    def _reply(self, call_id: int, idle: Optional[Callable[[], None]]) -> Any:
        frames = self._early.pop(call_id, None)
        idle_at = time.monotonic() + _IDLE_EVERY_S
        while frames is None:
            if self._failure is not None:
                raise self._failure
            try:  # a blocking read (RCVTIMEO): the monitor is looked at after each 0.2 s of silence, `idle` each second
                got = self._socket.recv_multipart(copy=False)
            except zmq.Again:
                self._read_events()
                if self._failure is None and idle is not None and time.monotonic() >= idle_at:
                    idle_at = time.monotonic() + _IDLE_EVERY_S
                    idle()
                continue
            got_id = wire.envelope(got[0])[1]
            if got_id == call_id:
                frames = got
            else:
                self._early[got_id] = got
        message = wire.decode(frames)
        if type(message) is wire.Reply:
            return message.value
        raise message.exception(self.to)

    def __del__(self) -> None:  # dropped unclosed (its thread ended): pyzmq would close the sockets in any order
        socket = getattr(self, "_socket", None)
        if socket is not None and not socket.closed:
            self.close()

    def _read_events(self) -> None:
        while self._monitor.poll(0):
            self._event(recv_monitor_message(self._monitor)["event"])

    def _event(self, event: int) -> None:
        self._failure = self._failure or self._watch.event(event)

    def close(self) -> None:
        close_monitored(self._socket, self._monitor)
        if self._failure is None:
            self._failure = peer_lost(f"{self.me}'s direct channel to {self.to} is closed", self.to)


class DirectCall:
    """A call sent on a DirectChannel whose reply has not been read yet."""

    def __init__(self, channel: DirectChannel, call_id: int):
        self.channel, self.call_id = channel, call_id

    def result(self, idle: Optional[Callable[[], None]] = None) -> Any:
        """The called function's value (or its exception), read in this thread; `idle()` every second of waiting."""
        return self.channel._reply(self.call_id, idle)
