"""Where the all-reduce replicas meet: the process group's store, with a deadline and names.

torch's own rendezvous (`init_process_group(init_method="env://")`) waits its whole collective
timeout for a replica that never comes and then says how many clients it counted. Here every
replica marks itself present in the same store first, and a replica still missing at the join
timeout is named with its address; the store is then handed to `init_process_group`.
"""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Sequence

from towerflow.cluster import transport as _transport
from towerflow.errors import ClusterError, ClusterTimeoutError

_POLL = 0.05
_SAY_EVERY = 5.0


def replica_names(cluster: Dict[str, List[str]], world_size: int) -> List[str]:
    """'/job:worker/task:1 at host:port' for each rank (chief, then workers), or 'rank r' without a cluster."""
    named = [f"/job:{job}/task:{i} at {address}" for job in ("chief", "master", "worker")
             for i, address in enumerate(cluster.get(job, []))]
    return named if len(named) == world_size else [f"rank {r}" for r in range(world_size)]


def join(master_addr: str, master_port: int, rank: int, names: Sequence[str], timeout: float) -> _transport.Store:
    """Meet the other replicas in the store at master_addr:master_port (rank 0 hosts it).

    Raises ClusterTimeoutError naming the missing replicas when they are not all there after
    `timeout` seconds (rank 0's store unreachable counts as rank 0 missing).
    """
    me, world = names[rank], len(names)
    deadline = time.monotonic() + timeout
    try:
        store = _transport.group_store(master_addr, master_port, rank == 0, timeout)
    except RuntimeError as e:  # a client that never reached rank 0's store
        raise ClusterTimeoutError(
            f"{me} gave up after {timeout:g} s: the first replica {names[0]} (its process group at "
            f"{master_addr}:{master_port}) never answered. Start it, check that this host reaches that address, or "
            f"raise TOWERFLOW_JOIN_TIMEOUT. ({str(e).splitlines()[0]})",
            task=me, missing=[names[0]],
        ) from None
    store.set(f"towerflow/replica/{rank}", "1")
    said = time.monotonic()
    while True:
        try:
            missing = [names[r] for r in range(world) if not store.check([f"towerflow/replica/{r}"])]
        except RuntimeError:  # rank 0 hosts the store: it went away
            raise ClusterError(f"{me} lost the first replica {names[0]} (it hosts the process group's store at "
                               f"{master_addr}:{master_port}) while the replicas were meeting", task=names[0]) from None
        if not missing:
            return store
        now = time.monotonic()
        if now > deadline:
            raise ClusterTimeoutError(
                f"{me} gave up after {timeout:g} s with {world - len(missing)} of {world} replicas in the process "
                f"group; missing: {', '.join(missing)}. Start the missing tasks, or raise the timeout with "
                "TOWERFLOW_JOIN_TIMEOUT.",
                task=me, missing=missing,
            )
        if now - said >= _SAY_EVERY:
            print(f"towerflow: {me}: waiting for {missing[0]} — {world - len(missing)} of {world} replicas up",
                  file=sys.stderr, flush=True)
            said = now
        time.sleep(_POLL)
