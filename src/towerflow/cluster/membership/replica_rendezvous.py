"""Where the all-reduce replicas meet: the process group's store, with a deadline and names.

torch's own rendezvous (`init_process_group(init_method="env://")`) waits its whole collective
timeout for a replica that never comes and then says how many clients it counted. Here every
replica marks itself present in the same store first, and a replica still missing at the join
timeout is named with its address; the store is then handed to `init_process_group`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from towerflow import _log
from towerflow.cluster.store import c10d as _c10d
from towerflow.errors import ClusterError, ClusterTimeoutError, PeerLost

_POLL = 0.05
_SAY_EVERY = 5.0


def replica_names(cluster: Dict[str, List[str]], world_size: int) -> List[str]:
    """'/job:worker/task:1 at host:port' for each rank (chief, then workers), or 'rank r' without a cluster."""
    named = [f"/job:{job}/task:{i} at {address}" for job in ("chief", "master", "worker")
             for i, address in enumerate(cluster.get(job, []))]
    return named if len(named) == world_size else [f"rank {r}" for r in range(world_size)]


def join(master_addr: str, master_port: int, rank: int, names: Sequence[str], timeout: float,
         prefix: Optional[str] = None) -> _c10d.Store:
    """Meet the other replicas in the store at master_addr:master_port (rank 0 hosts it; with `prefix`,
    torchrun's agent does, and every replica meets under that prefix as a client).

    Raises ClusterTimeoutError naming the missing replicas when they are not all there after
    `timeout` seconds (rank 0's store unreachable counts as rank 0 missing).
    """
    me, world = names[rank], len(names)
    deadline = time.monotonic() + timeout
    try:
        store = group_store(master_addr, master_port, rank == 0 and prefix is None, timeout, prefix)
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
            _log.get("cluster", me).info(f"waiting for {missing[0]} — {world - len(missing)} of {world} replicas up")
            said = now
        time.sleep(_POLL)


def group_store(master_addr: str, master_port: int, hosting: bool, timeout: float,
                prefix: Optional[str] = None) -> _c10d.Store:
    """The replicas' store (served here when `hosting`), seen under `prefix` when one is given."""
    store = _c10d.replica_group_store(master_addr, master_port, hosting, timeout)
    return _c10d.prefix_store(prefix, store) if prefix else store


class Heartbeat:
    """Every replica beats in the group's store; a thread watches the others.

    A collective waiting on a replica that hangs or whose host is cut off from the network waits
    the whole collective timeout (gloo sees no error: the connection just goes quiet). When a
    replica that has not finished stops beating for `timeout` seconds, this one says which, and
    where, and exits, so that the launcher reports it and, with --max-restarts, restarts the group.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, names: Sequence[str], timeout: float,
                 store: Optional[_c10d.Store] = None, every: float = 1.0, prefix: Optional[str] = None):
        self.rank, self.names, self.timeout, self.every = rank, list(names), timeout, every
        # rank 0 uses the store it serves; the others their own connection with a short timeout, so
        # that a cut-off rank 0 makes a store call fail instead of blocking the watch
        self._store = store if rank == 0 and store is not None else group_store(
            master_addr, master_port, False, timeout, prefix)
        self._stop = threading.Event()
        self._last_contact = time.monotonic()  # when the store last answered
        self._threads = [threading.Thread(target=self._beat, name="towerflow-replica-heartbeat", daemon=True),
                         threading.Thread(target=self._watch_store, name="towerflow-replica-store-watch", daemon=True)]

    def start(self) -> "Heartbeat":
        for t in self._threads:
            t.start()
        return self

    def finish(self) -> None:
        """This replica is done: the others stop watching it (an exit after this is not a loss)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._store.set(f"towerflow/done/{self.rank}", "1")
        except RuntimeError:
            pass
        # let the beat finish its store call: a thread still inside libtorch while the process exits is
        # one suspect of a rare abort at a replica's exit; a store cut off gets no more than this
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(2 * self.every)

    def release(self) -> None:
        """After `finish` and the group's last barrier: let go of the store connection (rank 0: the group's
        store itself) now, so that it is closed while the process runs, not among the objects torn down at
        interpreter exit; kept while a beat thread still uses it."""
        if self._stop.is_set() and not any(t.is_alive() for t in self._threads):
            self._store = None

    def _beat(self) -> None:
        seen: Dict[int, tuple] = {}  # rank -> (beat count, when it last changed)
        while not self._stop.wait(self.every):
            try:
                self._store.add(f"towerflow/beat/{self.rank}", 1)
                silent = self._silent(seen, time.monotonic())
            except RuntimeError:  # the store failed: _watch_store counts the silence
                continue
            self._last_contact = time.monotonic()
            if silent is not None and not self._stop.is_set():
                self._lost(*silent)

    def _watch_store(self) -> None:
        """A store call to a rank 0 cut off by the network may block rather than fail: watch the clock."""
        while not self._stop.wait(self.every):
            quiet = time.monotonic() - self._last_contact
            if quiet > self.timeout + self.every and not self._stop.is_set():
                self._lost(0, quiet)

    def _silent(self, seen: Dict[int, tuple], now: float) -> Optional[tuple]:
        for r in range(len(self.names)):
            if r == self.rank or self._store.check([f"towerflow/done/{r}"]):
                continue
            count = self._store.add(f"towerflow/beat/{r}", 0)
            if r not in seen or seen[r][0] != count:
                seen[r] = (count, now)
            elif now - seen[r][1] > self.timeout:
                return r, now - seen[r][1]
        return None

    def _lost(self, rank: int, silent: float) -> None:
        from towerflow.cluster.membership import failures

        error = PeerLost(
            f"{self.names[rank]} stopped answering: no heartbeat for {silent:.0f} s and it never finished (killed, "
            "hung, or its host cut off). The all-reduce cannot go on without it; this replica exits. Launch with "
            "--max-restarts N to restart the replicas from the newest checkpoint (the wait is "
            "TOWERFLOW_HEARTBEAT_TIMEOUT).", task=self.names[rank].split(" at ")[0])
        failures.record(error)  # a consequence: the launcher's verdict names the silent replica
        _log.get("cluster", self.names[self.rank]).error(str(error))
        sys.stdout.flush()
        os._exit(1)  # the main thread is inside a collective that cannot be interrupted
