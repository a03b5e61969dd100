"""The cluster of a scheduler that gives only ranks (Open MPI, torchrun or a PyTorchJob across nodes):
its addresses gathered at runtime, where one process's environment does not say where the others run.

Every rank meets the others in a c10d store at the resolver's rendezvous (`Resolved.rendezvous`,
MASTER_ADDR:MASTER_PORT): rank 0 hosts it, except under torchrun, whose agent already serves
a store there (TORCHELASTIC_USE_AGENT_STORE=True: every rank is a client). Each rank publishes
its host (the address of this machine that routes to the rendezvous host, the one the others
know it by) and its port; all wait for every rank, bounded by the join timeout and naming the
ranks that never came, and build the cluster in rank order with the resolver's roles.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import TYPE_CHECKING, List, Mapping, Optional

from towerflow._waiting import wait_until
from towerflow.cluster import addresses as _addresses
from towerflow.cluster.ports import PortReservation
from towerflow.cluster.schedulers.base import Resolved
from towerflow.cluster.spec import ClusterSpec, split_address
from towerflow.errors import ClusterTimeoutError, SchedulerError

if TYPE_CHECKING:
    from towerflow.cluster.store.c10d import Store

_POLL = 0.05
_PREFIX = "towerflow/gather"


def complete(resolved: Resolved, timeout: float, env: Optional[Mapping[str, str]] = None) -> Resolved:
    """`resolved` with its cluster: as it is when the scheduler's environment said it, else gathered now."""
    if resolved.cluster is not None:
        return resolved
    if not resolved.rendezvous or resolved.rank is None or resolved.world_size is None:
        raise SchedulerError(f"the {resolved.scheduler} environment gives neither the cluster nor a rendezvous with "
                             "this task's rank; set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port")
    env = env or {}
    host, port = split_address(resolved.rendezvous, f"the {resolved.scheduler} rendezvous")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = _store(host, port, hosting=resolved.rank == 0 and not agent_store, timeout=timeout)
    prefix = f"{_PREFIX}/{env.get('TORCHELASTIC_RUN_ID', '')}/{resolved.restart_count}"
    own_port = resolved.port or _free_port()
    here = _addresses.route_source(_addresses.resolve(host, f"the {resolved.scheduler} rendezvous")[0])
    store.set(f"{prefix}/{resolved.rank}", _join(here, own_port))
    names = _wait(store, prefix, resolved, timeout)
    # A rank on the rendezvous host reaches it over loopback (its own name maps to 127.0.0.1, as
    # Debian ships): once the others have said where they are, it takes the address it routes to
    # them from, and every rank reads the final addresses.
    remote = next((n for n in names if not _is_loopback(split_address(n)[0])), None)
    if remote is not None and _is_loopback(here):
        here = _addresses.route_source(split_address(remote)[0])
    store.set(f"{prefix}/final/{resolved.rank}", _join(here, own_port))
    names = _wait(store, f"{prefix}/final", resolved, timeout)
    store.set(f"{prefix}/read/{resolved.rank}", "1")
    if resolved.rank == 0 and not agent_store:  # the store lives in this process: keep it until all have read
        _wait(store, f"{prefix}/read", resolved, timeout)
    cluster, start = {}, 0
    for job, n in resolved.jobs.items():  # in the order the jobs take ranks
        cluster[job] = names[start:start + n]
        start += n
    ClusterSpec(cluster)  # two ranks that published one address fail here, naming the task
    return dataclasses.replace(resolved, cluster=cluster, port=own_port)


def _store(host: str, port: int, hosting: bool, timeout: float) -> Store:
    from towerflow.cluster.store import c10d as _c10d  # here: a slot whose scheduler names the cluster needs no torch

    if hosting:  # every interface: the others reach rank 0 by whatever address MASTER_ADDR is to them
        try:
            return _c10d.host_store(_c10d.listen("0.0.0.0", port), timeout)
        except OSError as e:
            raise SchedulerError(f"rank 0 cannot host the rendezvous on port {port} (MASTER_PORT): {e.strerror}; "
                                 "choose a free port with MASTER_PORT") from None
    wait_until(lambda: _c10d.port_is_open(host, port), timeout,
               f"gave up after {timeout:g} s: nothing answers at the rendezvous {host}:{port} (rank 0 hosts it); "
               "start rank 0, check MASTER_ADDR/MASTER_PORT, or raise TOWERFLOW_JOIN_TIMEOUT", 0.2,
               lambda text: ClusterTimeoutError(text, missing=["rank 0"]))
    return _c10d.connect_store(host, port, timeout)


def _wait(store: Store, prefix: str, resolved: Resolved, timeout: float) -> List[str]:
    """Every rank's value under `prefix`, in rank order; ClusterTimeoutError names the missing ranks."""
    keys = [f"{prefix}/{r}" for r in range(resolved.world_size)]
    missing: List[int] = []

    def all_set() -> bool:
        missing[:] = [r for r, k in enumerate(keys) if not store.check([k])]
        return not missing

    wait_until(all_set, timeout,
               lambda: f"rank {resolved.rank} gave up after {timeout:g} s at the rendezvous {resolved.rendezvous} with "
                       f"{resolved.world_size - len(missing)} of {resolved.world_size} ranks; missing: rank "
                       f"{', '.join(map(str, missing))}. Start them, or raise TOWERFLOW_JOIN_TIMEOUT.",
               _POLL, lambda text: ClusterTimeoutError(text, missing=[f"rank {r}" for r in missing]))
    return [store.get(k).decode() for k in keys]


def _is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host.strip("[]")).is_loopback


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_HELD: List[PortReservation] = []  # this process's own ports, held for its life (cluster/ports.py)


def _free_port() -> int:
    """A port for this rank, held until the process ends: the others learn it now, the task binds it later."""
    _HELD.append(PortReservation(1, host="0.0.0.0"))
    return _HELD[-1].ports[0]
