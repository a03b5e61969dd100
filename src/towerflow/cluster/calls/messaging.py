"""Remote calls between tasks on ZeroMQ: one serving socket per task, a connection per peer called.

Each task binds one ROUTER socket on the interface of its cluster address and publishes where
(`tcp://host:port`) in the rendezvous store under its call name; a caller looks the name up once,
connects a DEALER socket to it on the first call and keeps it. Joining is writing one key: no
group, no membership round, no token to hold. A restarted task binds anew under a new name.

One thread per process owns every socket (ZeroMQ sockets are not thread-safe): callers hand it
their calls through an inproc queue and wait on a torch Future; the thread sends, receives,
completes futures and dispatches incoming calls. A called function marked `deferred` runs on
that thread and returns a future (it must not block: a ps holds a sync pull that way); one marked
`quick` runs there too and answers at once; any other runs on a pool of threads. A peer's connection that closes (its process ended), never opens
(nothing listens there any more) or misses ZeroMQ's heartbeats (its host went away) fails the
calls waiting on it with `ConnectionLost`; a peer that refuses this task's credentials fails them
with ClusterJoinError.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
import traceback
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from towerflow import _log
from towerflow.cluster.calls import wire
from towerflow.cluster.calls.wire_security import ENCRYPT, WireSecurity
from towerflow.cluster.calls.connection_events import ConnectionWatch, close_monitored, peer_lost, monitor, stop_monitors, unknown
from towerflow.errors import ClusterTimeoutError

_HEARTBEAT_EVERY_MS = 1000
_CALL, _REPLY, _STOP, _RECONNECT = b"c", b"r", b"s", b"n"  # what the outbox carries to the socket thread

deferred, quick = wire.deferred, wire.quick


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Peer:
    """A connection to one task, owned by the socket thread."""

    def __init__(self, name: str, address: str, socket: zmq.Socket, monitor: zmq.Socket, watch: ConnectionWatch):
        self.name, self.address, self.socket, self.monitor, self.watch = name, address, socket, monitor, watch
        self.failure: Optional[BaseException] = None  # set once: the peer is gone for good
        # calls a send could not queue yet (no connection to queue on: one being made, or a refused
        # handshake being retried); sent in order once the socket can take them
        self.backlog: Deque[List[Any]] = collections.deque()
        self.waits_to_send = False


class Endpoint:
    """This task's serving socket, its connections to the tasks it calls, and the thread that owns them."""

    def __init__(self, name: str, host: str, security: WireSecurity, resolve: Callable[[str], Optional[str]],
                 heartbeat_timeout: float, threads: int = 16):
        self.name = name
        self._resolve = resolve
        self._security = security
        self._heartbeat_timeout_ms = max(int(heartbeat_timeout * 1000), 2 * _HEARTBEAT_EVERY_MS)
        self._context = zmq.Context()
        self._gate = security.start_gate(self._context, name)
        self._server = self._context.socket(zmq.ROUTER)
        self._server.ipv6 = ":" in host
        security.serve(self._server)
        port = self._server.bind_to_random_port(f"tcp://{_zmq_host(host)}")
        self.address = f"tcp://{_zmq_host(host)}:{port}"
        inbox = f"inproc://towerflow-outbox-{id(self)}"
        self._outbox_in = self._context.socket(zmq.PULL)
        self._outbox_in.bind(inbox)
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.sndhwm = 0
        self._outbox.connect(inbox)
        self._outbox_lock = threading.Lock()
        self._addresses: Dict[str, str] = {}
        self._peers: Dict[str, _Peer] = {}  # socket thread only, as is _by_socket
        self._by_socket: Dict[zmq.Socket, _Peer] = {}  # a peer's DEALER and its monitor socket
        self._pending: Dict[int, Tuple[torch.futures.Future, str, float]] = {}  # call id -> (future, peer, deadline)
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._deadlines = 0  # calls with a deadline made so far: until the first, the loop checks none
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"towerflow-call {name}")
        self._poller = zmq.Poller()
        for s in (self._server, self._outbox_in):
            self._poller.register(s, zmq.POLLIN)
        self.served: Dict[type, Any] = {}  # the state the functions called here share, by kind (`endpoint.served`)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"towerflow-messaging {name}", daemon=True)
        self._thread.start()

    # ---- the caller's side (any thread)

    def call(self, to: str, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None,
             timeout: float = 0) -> torch.futures.Future:
        """Run fn(*args, **kwargs) on task `to`; a future of its value. `timeout` > 0: fail after that many seconds."""
        future: torch.futures.Future = torch.futures.Future()
        if self._stopped.is_set():
            future.set_exception(peer_lost(f"{self.name} has left the cluster: it calls no task any more", to))
            return future
        address = self._address_of(to)
        if address is None:
            future.set_exception(unknown(to))
            return future
        call_id = next(self._ids)
        frames = wire.encode(call_id, wire.Call(fn, args, kwargs))
        with self._pending_lock:
            self._pending[call_id] = (future, to, time.monotonic() + timeout if timeout > 0 else 0.0)
            self._deadlines += timeout > 0
        self._post([_CALL, to.encode(), address.encode(), *frames])
        return future

    def _address_of(self, to: str) -> Optional[str]:
        """Where task `to` listens: looked up in the store once, then remembered (a call name is never reused)."""
        address = self._addresses.get(to)
        if address is None:
            address = self._resolve(to)
            if address is not None:
                self._addresses[to] = address
        return address

    def _post(self, frames: List[Any]) -> None:
        with self._outbox_lock:
            if not self._outbox.closed:  # closed: this task has left, and its late replies go nowhere
                self._outbox.send_multipart(frames, copy=False)

    # ---- the socket thread

    def _run(self) -> None:
        try:
            while True:
                for socket, events in self._poller.poll(self._poll_ms()):
                    try:
                        if socket is self._server:
                            self._serve(socket.recv_multipart(copy=False))
                        elif socket is self._outbox_in:
                            if not self._from_outbox(socket.recv_multipart(copy=False)):
                                return
                        else:
                            self._from_peer(socket, events)
                    except Exception:  # one message's trouble; the thread serves every connection of the task
                        _log.get("cluster", self.name).warning(
                            "the messaging thread failed to handle a message and goes on:", exc_info=True)
                self._expire()
        finally:
            self._close_sockets()

    def _poll_ms(self) -> int:
        if not self._deadlines:
            return -1
        with self._pending_lock:
            deadlines = [d for _, _, d in self._pending.values() if d]
        return -1 if not deadlines else max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _from_outbox(self, frames: List[zmq.Frame]) -> bool:
        kind = frames[0].bytes
        if kind == _REPLY:
            self._server.send_multipart(frames[1:], copy=False)
        elif kind == _CALL:
            to, address = frames[1].bytes.decode(), frames[2].bytes.decode()
            try:
                peer = self._peer(to, address)
                failure = peer.failure
            except zmq.ZMQError as e:
                failure = peer_lost(f"{self.name} could not open a connection to {to} at {address}: {e}", to)
            if failure is not None:
                self._fail_call(wire.envelope(frames[3])[1], failure)
            else:
                peer.backlog.append(frames[3:])
                self._send_backlog(peer)
        elif kind == _RECONNECT:
            peer = self._peers.get(frames[1].bytes.decode())
            if peer is not None and peer.failure is not None:
                del self._peers[peer.name]
        else:
            return False
        return True

    def reconnect(self, to: str) -> None:
        """Let the next call to `to` open a new connection, its last one having been lost while the task may live on
        (cut off from this one, not dead); calls made before this failed with that loss. Its address is looked up
        again too."""
        self._addresses.pop(to, None)
        self._post([_RECONNECT, to.encode()])

    def _send_backlog(self, peer: _Peer) -> None:
        """Send `peer`'s waiting calls without blocking: a DEALER with no connection to queue on blocks a send,
        and this thread must stay free to see the monitor's verdict and the deadlines."""
        try:
            while peer.backlog:
                peer.socket.send_multipart(peer.backlog[0], copy=False, flags=zmq.NOBLOCK)
                peer.backlog.popleft()
        except zmq.Again:
            pass
        if bool(peer.backlog) != peer.waits_to_send:  # woken when it can take them
            peer.waits_to_send = bool(peer.backlog)
            self._poller.modify(peer.socket, zmq.POLLIN | (zmq.POLLOUT if peer.waits_to_send else 0))

    def _peer(self, name: str, address: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            socket = self._context.socket(zmq.DEALER)
            self._configure_dealer(socket, address)
            watcher = monitor(socket)
            socket.connect(address)
            peer = self._peers[name] = _Peer(name, address, socket, watcher, self._watch(name, address))
            for s in (socket, watcher):
                self._poller.register(s, zmq.POLLIN)
                self._by_socket[s] = peer
        return peer

    def _configure_dealer(self, socket: zmq.Socket, address: str) -> None:
        socket.linger = 0
        socket.ipv6 = address.startswith("tcp://[")
        socket.heartbeat_ivl = _HEARTBEAT_EVERY_MS
        socket.heartbeat_timeout = self._heartbeat_timeout_ms
        socket.connect_timeout = self._heartbeat_timeout_ms
        self._security.dial(socket)

    def _watch(self, to: str, address: str) -> ConnectionWatch:
        return ConnectionWatch(self.name, to, address, encrypted=self._security.mode == ENCRYPT)

    def is_socket_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def direct(self, to: str):
        """A `DirectChannel` to task `to` for the calling thread alone (cluster/calls/direct.py); ConnectionLost when no task
        of that name has published an address."""
        from towerflow.cluster.calls.direct import DirectChannel

        address = self._address_of(to)
        if address is None or self._stopped.is_set():
            raise unknown(to)
        return DirectChannel(self._context, self.name, to, address, lambda s: self._configure_dealer(s, address),
                             self._watch(to, address))

    def _from_peer(self, socket: zmq.Socket, events: int) -> None:
        peer = self._by_socket.get(socket)
        if peer is None:  # lost earlier in this same poll's events
            return
        if socket is peer.socket:
            if events & zmq.POLLOUT:
                self._send_backlog(peer)
            if events & zmq.POLLIN:
                self._reply_arrived(peer, socket.recv_multipart(copy=False))
        else:
            self._peer_event(peer, recv_monitor_message(socket)["event"])

    def _reply_arrived(self, peer: _Peer, frames: List[zmq.Frame]) -> None:
        call_id = wire.envelope(frames[0])[1]
        with self._pending_lock:
            entry = self._pending.pop(call_id, None)
        if entry is None:
            return  # timed out before it came
        future = entry[0]
        try:
            message = wire.decode(frames)
        except Exception as e:
            future.set_exception(e)
            return
        if type(message) is wire.Reply:
            future.set_result(message.value)
        else:
            future.set_exception(message.exception(peer.name))

    def _peer_event(self, peer: _Peer, event: int) -> None:
        error = peer.watch.event(event)
        if error is not None and peer.failure is None:
            self._lose(peer, error)

    def _lose(self, peer: _Peer, error: BaseException) -> None:
        """The peer is gone for good (a restarted task comes back under another name): fail its calls."""
        peer.failure = error
        peer.backlog.clear()  # their calls are pending: failed below
        for s in (peer.socket, peer.monitor):
            self._poller.unregister(s)
            del self._by_socket[s]
        close_monitored(peer.socket, peer.monitor)
        with self._pending_lock:
            lost = [cid for cid, (_, to, _) in self._pending.items() if to == peer.name]
        for cid in lost:
            self._fail_call(cid, error)

    def _fail_call(self, call_id: int, error: BaseException) -> None:
        with self._pending_lock:
            entry = self._pending.pop(call_id, None)
        if entry is not None:
            entry[0].set_exception(error)

    def _expire(self) -> None:
        if not self._deadlines:
            return
        now = time.monotonic()
        with self._pending_lock:
            late = [(cid, to) for cid, (_, to, d) in self._pending.items() if d and d <= now]
        for cid, to in late:
            self._fail_call(cid, ClusterTimeoutError(f"a call from {self.name} to {to} got no reply within its "
                                                     "deadline", task=to))

    # ---- the serving side

    def _serve(self, frames: List[zmq.Frame]) -> None:
        routing, body = frames[0], frames[1:]
        call_id = wire.envelope(body[0])[1]
        try:
            call = wire.decode(body)
            fn = call.fn
        except Exception as e:
            return self._answer(routing, call_id, None, e)
        if getattr(fn, wire.ANSWERS_LATER, False):
            try:
                result = fn(*call.args, **(call.kwargs or {}))
            except Exception as e:
                return self._answer(routing, call_id, None, e)
            if result.done():  # answered at once (an async ps step): no callback round
                self._answer_future(routing, call_id, result)
            else:
                result.add_done_callback(lambda f: self._answer_future(routing, call_id, f))
        elif getattr(fn, wire.ANSWERS_AT_ONCE, False):
            self._run_call(routing, call_id, call)
        else:
            self._pool.submit(self._run_call, routing, call_id, call)

    def _run_call(self, routing: zmq.Frame, call_id: int, call: wire.Call) -> None:
        try:
            value = call.fn(*call.args, **(call.kwargs or {}))
        except Exception as e:
            return self._answer(routing, call_id, None, e)
        self._answer(routing, call_id, value, None)

    def _answer_future(self, routing: zmq.Frame, call_id: int, future: torch.futures.Future) -> None:
        try:
            value = future.value()
        except Exception as e:
            return self._answer(routing, call_id, None, e)
        self._answer(routing, call_id, value, None)

    def _answer(self, routing: zmq.Frame, call_id: int, value: Any, error: Optional[BaseException]) -> None:
        message = wire.Reply(value) if error is None else wire.failure_of(error, traceback.format_exc())
        try:
            frames = wire.encode(call_id, message)
        except Exception as e:  # the value does not pickle: say so instead of leaving the caller waiting
            frames = wire.encode(call_id, wire.failure_of(e, traceback.format_exc()))
        if threading.get_ident() == self._thread.ident:
            self._server.send_multipart([routing, *frames], copy=False)
        else:
            self._post([_REPLY, routing, *frames])

    # ---- stopping

    def close(self, linger_s: float = 0.0) -> None:
        """Stop: replies already queued get `linger_s` seconds to leave; calls still waiting fail."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._linger_ms = int(linger_s * 1000)
        self._post([_STOP])
        self._thread.join(10.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._pending_lock:
            waiting, self._pending = list(self._pending.values()), {}
        for future, to, _ in waiting:
            future.set_exception(peer_lost(f"{self.name} left the cluster while its call to {to} was waiting", to))
        self._gate.stop()
        stop_monitors(self._context)
        self._context.destroy(linger=0)

    def _close_sockets(self) -> None:
        linger = getattr(self, "_linger_ms", 0)
        for peer in self._peers.values():
            if peer.failure is None:
                close_monitored(peer.socket, peer.monitor)
        self._server.close(linger)
        self._outbox_in.close(0)
        with self._outbox_lock:
            self._outbox.close(0)
