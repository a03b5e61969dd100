"""The cluster's two channels, behind one module: the rendezvous store and remote calls.

The rendezvous is a c10d TCPStore hosted by the launcher or the coordinator task at its cluster
address, or a store in etcd that no task hosts (`etcd_store.py`, a `dist.Store` subclass: this
module and that one are the only cluster code that imports torch.distributed). Remote calls go
through this process's ZeroMQ endpoint (`messaging.py`); a task is reachable once its endpoint's
address is in the store, so joining costs one store write whatever the cluster's size
(docs/scaling.md). Measured choices: docs/benchmarks.md, "Messaging".
"""

from __future__ import annotations

import datetime
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from towerflow.cluster import shm_link as _shm_link
from towerflow.cluster import wire as _wire
from towerflow.errors import ClusterError, ClusterJoinError

Store = dist.Store


def port_is_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at host:port (a cheap check before a store connect)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """Hold host:port for this task: a listening socket bound to that address only (loopback stays loopback).

    Raises OSError: EADDRINUSE when the port is taken, EADDRNOTAVAIL when host is not this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a live listener still refuses
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(sock: socket.socket, timeout: float) -> dist.TCPStore:
    """Serve the rendezvous store on a socket from `listen()` (TCPStore alone would bind every interface)."""
    host, port = sock.getsockname()[:2]
    store = dist.TCPStore(
        host,
        port,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        use_libuv=True,
    )
    sock.detach()  # the store owns the descriptor now and closes it when it goes
    return store


def connect_store(host: str, port: int, timeout: float, answer_within: float = 10.0) -> dist.TCPStore:
    """Connect to a coordinator's store that is known to be listening.

    A TCPStore client waits forever on a port that accepts but never answers (another
    program), so the connect runs in a helper thread and gives up after `answer_within` s.
    """
    out: Dict[str, Any] = {}

    def connect() -> None:
        try:
            out["store"] = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # handed to the caller below
            out["error"] = e

    t = threading.Thread(target=connect, name="towerflow-store-connect", daemon=True)
    t.start()
    t.join(answer_within)
    if t.is_alive():
        raise ClusterJoinError(
            f"something at {host}:{port} accepts connections but does not answer as a towerflow coordinator "
            "(another program on that port?). Free the port or change the cluster spec."
        )
    if "error" in out:
        raise out["error"]
    return out["store"]


def connect_etcd(endpoints, prefix: str, timeout: float, reach_within: float) -> Store:
    """The store in etcd under `prefix` (cluster/etcd_store.py), which no task hosts; ConnectionError
    (EtcdUnavailable, naming each member's error) when no member answers within `reach_within` s."""
    from towerflow.cluster.etcd_store import EtcdStore

    return EtcdStore(endpoints, prefix, timeout, reach_within=reach_within)


def prefix_store(prefix: str, store: Store) -> Store:
    return dist.PrefixStore(prefix, store)


_endpoint = None  # this process's messaging.Endpoint, while it is part of a cluster (zmq is imported only then)
_ADDRESS_KEY = "calls/address/"  # + a task incarnation's call name: where its endpoint listens


def start_endpoint(store: Store, name: str, host: str, security, heartbeat_timeout: float) -> str:
    """Serve remote calls as `name` on `host` and publish where in the store: from then on any task can call
    this one (there is no group to join). Returns the address bound."""
    global _endpoint
    if _endpoint is not None:
        raise ClusterJoinError(f"this process already serves remote calls as {_endpoint.name}; one task per process")

    def resolve(peer: str) -> Optional[str]:
        key = _ADDRESS_KEY + peer
        try:
            return store.get(key).decode() if store.check([key]) else None
        except Exception:  # the store's host is gone: a peer not called before cannot be found
            return None

    from towerflow.cluster import messaging

    endpoint = messaging.Endpoint(name, host, security, resolve, heartbeat_timeout)
    store.set(_ADDRESS_KEY + name, endpoint.address)
    _endpoint = endpoint
    return endpoint.address


def is_peer_lost(error: BaseException) -> bool:
    """Whether a failed remote call failed because the other task is gone (its process ended, its host went
    away, or it was replaced by a restarted incarnation), rather than because the called function raised."""
    from towerflow.cluster.shm_link import LinkClosed

    events = sys.modules.get("towerflow.cluster.connection_events")  # not imported: no call was made, none was lost
    return isinstance(error, LinkClosed) or (events is not None and isinstance(error, events.PeerGone))


def is_group_peer_lost(error: BaseException) -> bool:
    """Whether a collective of the replicas' process group failed because a member is gone (gloo's
    'Connection reset by peer' / 'closed by peer' / broken pipe), rather than because of this replica."""
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    gone = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ECONNRESET", "EPIPE")
    return ("gloo" in text or isinstance(error, dist.DistError)) and any(g in text for g in gone)


def group_store() -> Optional[Store]:
    """The store of this process's default process group (its rank 0 hosts it), or None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def stop_endpoint(graceful: bool = True, everyone_leaving: Optional[Callable[[], None]] = None) -> None:
    """Stop serving and calling. `everyone_leaving`, for a whole cluster ending together, is a barrier
    over all tasks passed before closing, so no task closes while another still waits on a reply of its."""
    global _endpoint
    endpoint = _endpoint
    if endpoint is None:
        return
    if graceful and everyone_leaving is not None:
        everyone_leaving()
    _endpoint = None
    _shm_link.stop_servers()  # a same-host link answering on would fail each step with "serves no endpoint"
    endpoint.close(linger_s=2.0 if graceful else 0.0)


def is_endpoint_running() -> bool:
    return _endpoint is not None


def call_async(to: str, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, timeout: float = 0) -> torch.futures.Future:
    """Run fn(*args, **kwargs) on task `to` (its call name); tensors in args and the result travel as frames.
    `timeout` > 0: the future fails with ClusterTimeoutError when no reply came by then."""
    return _serving(to).call(to, fn, args, kwargs, timeout)


def direct_channel(to: str):
    """A connection to task `to` (its call name) that only the calling thread uses: cluster/direct.py."""
    return _serving(to).direct(to)


def reconnect(to: str) -> None:
    """The next call to task `to` opens a new connection: its last one was lost, and the task may live on."""
    _serving(to).reconnect(to)


def on_socket_thread() -> bool:
    """Whether the calling thread is this process's messaging thread (which runs `deferred` functions and must
    not wait on a reply)."""
    return _endpoint is not None and _endpoint.is_socket_thread()


def _serving(to: str):
    if _endpoint is None:
        raise ClusterError(f"cannot call {to}: this process serves no endpoint (start towerflow.Server first)", task=to)
    return _endpoint


deferred = _wire.deferred
quick = _wire.quick


def replica_group_store(host: str, port: int, is_master: bool, timeout: float) -> dist.TCPStore:
    """The store of a replicas' process group at MASTER_ADDR:MASTER_PORT: rank 0 serves it (not waiting
    for the others: `replica_rendezvous` does that and names whoever is missing), the rest connect,
    retrying until `timeout`."""
    started = time.monotonic()
    if not is_master:
        _wait_until_listening(host, port, timeout)
    remaining = max(1.0, timeout - (time.monotonic() - started))
    return dist.TCPStore(host, port, None, is_master, timeout=datetime.timedelta(seconds=remaining),
                         wait_for_workers=False)


def _wait_until_listening(host: str, port: int, timeout: float) -> None:
    """Wait until something accepts connections at host:port; RuntimeError after `timeout` s. torch's store
    client would retry as well, but prints a C++ stack trace on every failed try before its error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"nothing accepted a connection at {host}:{port} within {timeout:g} s ({e})") from None
            time.sleep(0.1)
