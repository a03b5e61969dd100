"""This process's endpoint for calls between tasks, while it is part of a cluster: start, call, stop, and the
state that the functions called here share (`served`).

Calls go through one ZeroMQ endpoint per process (`messaging.py`); a task is reachable once its
endpoint's address is in the rendezvous store, so joining costs one store write whatever the
cluster's size (docs/scaling.md). Measured choices: docs/benchmarks.md, "Messaging".
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Type, TypeVar

import torch

from towerflow.cluster.calls import wire as _wire
from towerflow.cluster.link import shm_link as _shm_link
from towerflow.errors import ClusterError, ClusterJoinError

_current = None  # this process's messaging.Endpoint, while it is part of a cluster (zmq is imported only then)
_ADDRESS_KEY = "calls/address/"  # + a task incarnation's call name: where its endpoint listens
_making_served = threading.Lock()
T = TypeVar("T")

deferred = _wire.deferred
quick = _wire.quick


def start_endpoint(store, name: str, host: str, security, heartbeat_timeout: float) -> str:
    """Serve remote calls as `name` on `host` and publish where in the store (a `torch.distributed.Store`): from then
    on any task can call this one (there is no group to join). Returns the address bound."""
    global _current
    if _current is not None:
        raise ClusterJoinError(f"this process already serves remote calls as {_current.name}; one task per process")

    def resolve(peer: str) -> Optional[str]:
        key = _ADDRESS_KEY + peer
        try:
            return store.get(key).decode() if store.check([key]) else None
        except Exception:  # the store's host is gone: a peer not called before cannot be found
            return None

    from towerflow.cluster.calls import messaging

    endpoint = messaging.Endpoint(name, host, security, resolve, heartbeat_timeout)
    store.set(_ADDRESS_KEY + name, endpoint.address)
    _current = endpoint
    return endpoint.address


def stop_endpoint(graceful: bool = True, everyone_leaving: Optional[Callable[[], None]] = None) -> None:
    """Stop serving and calling. `everyone_leaving`, for a whole cluster ending together, is a barrier
    over all tasks passed before closing, so no task closes while another still waits on a reply of its."""
    global _current
    endpoint = _current
    if endpoint is None:
        return
    if graceful and everyone_leaving is not None:
        everyone_leaving()
    _current = None
    _shm_link.stop_servers()  # a same-host link answering on would fail each step with "serves no endpoint"
    endpoint.close(linger_s=2.0 if graceful else 0.0)


def is_endpoint_running() -> bool:
    return _current is not None


def call_async(to: str, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, timeout: float = 0) -> torch.futures.Future:
    """Run fn(*args, **kwargs) on task `to` (its call name); tensors in args and the result travel as frames.
    `timeout` > 0: the future fails with ClusterTimeoutError when no reply came by then."""
    return _serving(to).call(to, fn, args, kwargs, timeout)


def direct_channel(to: str):
    """A connection to task `to` (its call name) that only the calling thread uses: calls/direct.py."""
    return _serving(to).direct(to)


def reconnect(to: str) -> None:
    """The next call to task `to` opens a new connection: its last one was lost, and the task may live on."""
    _serving(to).reconnect(to)


def served(kind: Type[T], make: Callable[[], T]) -> T:
    """The one `kind` whose methods the calls to this task run (a ps task's `ServedModels`): made by `make` the first
    time it is asked for, by the task's program or by the first call that needs it, and kept as long as this
    endpoint serves (a task started again in this process starts with a new one)."""
    endpoint = _current
    if endpoint is None:
        raise ClusterError(f"no call can reach this process's {kind.__name__}: it serves no endpoint (start "
                           "towerflow.Server first)")
    state = endpoint.served.get(kind)
    if state is None:
        with _making_served:
            state = endpoint.served.get(kind)
            if state is None:
                state = endpoint.served[kind] = make()
    return state


def on_socket_thread() -> bool:
    """Whether the calling thread is this process's messaging thread (which runs `deferred` functions and must
    not wait on a reply)."""
    return _current is not None and _current.is_socket_thread()


def _serving(to: str):
    if _current is None:
        raise ClusterError(f"cannot call {to}: this process serves no endpoint (start towerflow.Server first)", task=to)
    return _current
