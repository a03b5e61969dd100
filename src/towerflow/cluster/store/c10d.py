"""The c10d stores: the rendezvous store a task or the launcher hosts, and a replicas' process-group store.

A TCPStore bound to one address only, served on a socket held from the moment its port is chosen
(`listen`, `host_store`); clients that give up on a port that accepts but never answers
(`connect_store`); keys under a prefix (`prefix_store`). With `etcd_store.py` the only cluster
code that imports torch.distributed.
"""

from __future__ import annotations

import datetime
import random
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from towerflow import _log
from towerflow._waiting import wait_until
from towerflow.errors import ClusterJoinError
from towerflow.taskenv import ENV_JOIN_TIMEOUT

Store = dist.Store
SLOW_CONNECT = 4.5  # s: a connection this slow waited on a resolver's timeout (5 s by default), as a rule


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
        sock.listen(socket.SOMAXCONN)  # a cluster's tasks connect at once (a hosted store listens again, as wide)
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


def connect_store(host: str, port: int, timeout: float, answer_within: Optional[float] = None) -> dist.TCPStore:
    """Connect to a coordinator's store that is known to be listening, within `answer_within` s (default:
    `timeout`, the store's own wait for a key).

    Hundreds of tasks connect at once when a cluster starts, to a store host that may be short of CPU
    for a while: a connection that fails is tried again after a jittered backoff (so that the retries
    do not arrive together), and an answer may take the whole wait. A TCPStore client waits forever on
    a port that accepts but never answers (another program), so each try runs in a helper thread.
    """
    within = timeout if answer_within is None else answer_within
    deadline = time.monotonic() + within
    tries, last_error = 0, None
    while True:
        tries += 1
        out: Dict[str, Any] = {}

        def connect() -> None:
            try:
                out["store"] = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))
            except Exception as e:  # handed to the caller below
                out["error"] = e

        t = threading.Thread(target=connect, name="towerflow-store-connect", daemon=True)
        started = time.monotonic()
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise ClusterJoinError(
                f"the store at {host}:{port} accepted a connection but gave no answer within {within:g} s ({tries} "
                f"tr{'ies' if tries > 1 else 'y'}{f'; before: {last_error}' if last_error else ''}): another program "
                "on that port, or a store host without CPU to spare. Free the port or change the cluster spec, or "
                f"raise the wait with {ENV_JOIN_TIMEOUT}."
            )
        if "store" in out:
            took = time.monotonic() - started
            if took >= SLOW_CONNECT:
                _log.get("cluster").warning(
                    f"connecting to the store at {host}:{port} took {took:.1f} s: as a rule the host's name resolver, "
                    "which torch's store client asks for the name of its own address and which did not answer "
                    "(docs/cluster.md, 'A join that takes 5 or 10 s more': name the address in /etc/hosts)")
            return out["store"]
        last_error = str(out["error"]).splitlines()[0]
        pause = min(2.0, 0.05 * 2 ** tries) * random.uniform(0.5, 1.5)
        if time.monotonic() + pause > deadline:
            raise ClusterJoinError(
                f"could not connect to the store at {host}:{port} within {within:g} s ({tries} tries; the last: "
                f"{last_error}). Check that it still runs and this host reaches it, or raise the wait with "
                f"{ENV_JOIN_TIMEOUT}."
            )
        time.sleep(pause)


def prefix_store(prefix: str, store: Store) -> Store:
    return dist.PrefixStore(prefix, store)


def group_store() -> Optional[Store]:
    """The store of this process's default process group (its rank 0 hosts it), or None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


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
    refused: List[OSError] = []

    def accepted() -> bool:
        try:
            socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))).close()
            return True
        except OSError as e:
            refused[:] = [e]
            return False

    wait_until(accepted, timeout, lambda: f"nothing accepted a connection at {host}:{port} within {timeout:g} s "
                                          f"({refused[0]})", 0.1, RuntimeError)
