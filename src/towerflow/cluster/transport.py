"""The only code that talks to torch.distributed for the cluster: the rendezvous store and RPC.

Choice (measured in benchmarks/transport.py, numbers in docs/benchmarks.md): remote calls go
through torch.distributed.rpc on TensorPipe. It matches c10d send/recv over gloo on large
tensors, gives request/response with Python callables for free, and its dynamic groups
(no world_size) let a task leave and a new one join, which the fault-tolerance work needs.
The rendezvous is a c10d TCPStore hosted by the coordinator task at its cluster address.
Swap this module to change either; nothing else imports torch.distributed.
"""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from towerflow import taskenv as _taskenv
from towerflow.errors import ClusterJoinError

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


def prefix_store(prefix: str, store: Store) -> Store:
    return dist.PrefixStore(prefix, store)


# TensorPipe's transports for the RPC control path (tensor payloads between processes of one host
# go by CMA, one process_vm_readv copy, whichever is chosen). "shm" runs a reactor thread that
# busy-polls a whole core for the life of the process, chosen or not: on a box with fewer cores
# than tasks that halved training steps/s (docs/benchmarks.md), so TCP ("uv") is the default.
RPC_TRANSPORTS = _taskenv.RPC_TRANSPORTS  # checked where the setting is read (taskenv)
DEFAULT_RPC_TRANSPORTS = ("uv",)


def start_rpc(store: Store, name: str, rank: int, timeout: float, num_threads: int = 16,
              transports: Sequence[str] = DEFAULT_RPC_TRANSPORTS) -> None:
    """Join the RPC group as `name`; dynamic membership (no world size) so tasks may come and go."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc
    from torch.distributed.rpc.backend_registry import BackendType

    # `_transports` is read by the constructor only: an attribute set afterwards is silently ignored
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout, num_worker_threads=num_threads,
                                              _transports=list(transports))
    dist_autograd._init(rank)  # init_rpc does this too; the agent refuses to start without it
    rpc._init_rpc_backend(BackendType.TENSORPIPE, prefix_store("rpc", store), name, rank, None, options)


_MEMBERS_KEY = "names/_ALL_WORKER_INFOS"  # where torch's dynamic RPC group lists its members ("name-rank,...")


def _forget_members(store: Store, names: Sequence[str]) -> List[Tuple[str, int]]:
    """Remove `names` from the RPC group's member list in the store (under torch's membership token)."""
    from torch.distributed.rpc._utils import _group_membership_management

    rpc_store = prefix_store("rpc", store)
    gone: List[Tuple[str, int]] = []
    with _group_membership_management(rpc_store, f"evict_{names[0]}", True):
        if not rpc_store.check([_MEMBERS_KEY]):
            return gone
        kept = []
        for entry in rpc_store.get(_MEMBERS_KEY).decode().split(","):
            if not entry:
                continue
            name, rank = entry.rsplit("-", 1)
            if name in names:
                gone.append((name, int(rank)))
            else:
                kept.append(entry + ",")
        rpc_store.set(_MEMBERS_KEY, "".join(kept))
    return gone


def _drop_peer(name: str, rank: int) -> None:
    """Runs on a live member: forget a dead one, as if it had left (torch's own leave message)."""
    from torch.distributed import rpc
    from torch.distributed.rpc._utils import _update_group_membership

    _update_group_membership(rpc.WorkerInfo(name, rank), [], {}, False)


def start_rpc_replacing(store: Store, name: str, rank: int, timeout: float, dead: Sequence[str],
                        transports: Sequence[str] = DEFAULT_RPC_TRANSPORTS) -> List[str]:
    """Join as `name` in place of dead members (killed, so they never left).

    torch's dynamic group would call every listed member while this task joins, and again
    when anyone leaves, and a killed one never answers: so the dead are taken off the list
    in the store first, and once joined this task tells each live member to drop them too.
    Returns the names that were dropped.
    """
    gone = _forget_members(store, list(dead)) if dead else []
    start_rpc(store, name, rank, timeout, transports=transports)
    for peer in peers():
        if peer != name:
            for dead_name, dead_rank in gone:
                call_async(peer, _drop_peer, args=(dead_name, dead_rank)).wait()
    return [n for n, _ in gone]


def is_peer_lost(error: BaseException) -> bool:
    """Whether a failed remote call failed because the other task is gone (killed, its host down),
    rather than because the called function raised: TensorPipe's own errors ('eof', 'ECONNREFUSED',
    'ECONNRESET', ... 'this error originated at tensorpipe/...') and calls to a member that was dropped
    or is no longer in this task's member list (it left the group)."""
    from towerflow.cluster.shm_link import LinkClosed

    if isinstance(error, LinkClosed):  # a same-host link's other end ended
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(s in text for s in ("LinkClosed: ", "originated at tensorpipe/", "Unknown destination worker", "ECONNREFUSED",
                                   "could not find destination name"))


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


def stop_rpc(graceful: bool = True, everyone_leaving: Optional[Callable[[], None]] = None) -> None:
    """Leave the RPC group (graceful: tell the others first) and stop the agent.

    `everyone_leaving`, for a whole cluster ending together, is a barrier over all members: each
    one leaves the group (which marks its agent as shutting down), waits in it, and only then
    closes its connections. Without it, whoever closes first makes every member still running log
    a TensorPipe warning per connection ("encountered error when reading incoming request ... EOF").
    """
    from torch.distributed import rpc

    if not is_rpc_running():
        return
    if graceful and everyone_leaving is not None:
        rpc.api._get_current_rpc_agent().join(shutdown=True)  # dynamic group: waits for our calls, leaves
        everyone_leaving()
        rpc.shutdown(graceful=False)  # the members have all left: just close
    else:
        rpc.shutdown(graceful=graceful)


def is_rpc_running() -> bool:
    from torch.distributed.rpc import api

    return api._is_current_rpc_agent_set()


def peers() -> Tuple[str, ...]:
    """Names of the tasks this task can currently reach by RPC."""
    from torch.distributed import rpc

    return tuple(w.name for w in rpc._get_current_rpc_agent().get_worker_infos())


def call_async(to: str, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, timeout: float = -1) -> torch.futures.Future:
    """Run fn(*args, **kwargs) on task `to`; tensors in args and the result travel as tensors."""
    from torch.distributed import rpc

    return rpc.rpc_async(to, fn, args=args, kwargs=kwargs or {}, timeout=timeout)


def deferred(fn: Callable) -> Callable:
    """Mark a module-level call target that returns a torch Future: the reply goes out when the
    future completes, and no server thread is held while it waits (a ps holding a pull until
    its step comes, for example). This is torch's `rpc.functions.async_execution`."""
    from torch.distributed import rpc

    return rpc.functions.async_execution(fn)


def replica_group_store(host: str, port: int, is_master: bool, timeout: float) -> dist.TCPStore:
    """The store of a replicas' process group at MASTER_ADDR:MASTER_PORT: rank 0 serves it (not waiting
    for the others: `replica_rendezvous` does that and names whoever is missing), the rest connect,
    retrying until `timeout`."""
    return dist.TCPStore(host, port, None, is_master, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)
