"""Rendezvous: the store where a cluster's tasks meet, and one task's place in it.

The store (stores.py) is etcd when the task environment names one, which no task hosts; else it is
hosted by the launcher for a local cluster (so that it outlives any task), else by the
coordinator, the first task in rank order, at its own address. A task
that joins checks that it has the same cluster spec and token as the store's publisher, claims
its slot (taking over a dead holder's slot when it is a restarted incarnation), and waits, with
a bound and naming who is missing, until every task has done the same. The store also keeps
small facts any task may read (`publish` / `lookup`).

Everything here comes in through constructor arguments: the caller (`Server`) reads the
environment, so that this module stays testable on a stand-in store.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import random
import socket
import time
from typing import Collection, Optional, Tuple

from towerflow.cluster import addresses as _addresses
from towerflow.cluster.membership import ending as _ending
from towerflow.cluster.store import stores as _stores
from towerflow.cluster.store.stores import proof
from towerflow import _log, etcd_url
from towerflow._waiting import wait_until
from towerflow import taskenv as _taskenv
from towerflow.cluster.store import c10d as _c10d
from towerflow.cluster.spec import ClusterSpec, split_address
from towerflow.errors import ClusterJoinError, ClusterTimeoutError

SAY_EVERY = 5.0  # seconds between repeated waiting messages
POLL = 0.1
CHECK_WINDOW = 64  # keys a poll of a wait for all asks about at first (`unmarked`)
BEAT_EVERY = 1.0  # each task bumps its heartbeat counter in the store this often (membership.py)


def task_name(job: str, index: int) -> str:
    return f"/job:{job}/task:{index}"


def _slot_taken(name: str, holder: dict) -> ClusterJoinError:
    return ClusterJoinError(
        f"{name} is already taken by another process (pid {holder.get('pid')} on {holder.get('host')}); a slot "
        "holds one task. Stop the other one, or start this one with a free --task_index.",
        task=name,
    )


class Rendezvous:
    """One task's place in the rendezvous store: hosts or joins the store, claims the task's slot,
    waits for the others, and keeps `incarnation`, which a claim may raise when it takes over from
    a dead holder.

    `store` is None until `host` or `join`; `binding` is None for a torchrun-named rank (its
    cluster entry is not its own address); `store_address` is the launcher's store, when it hosts one.
    """

    def __init__(self, cluster: ClusterSpec, job: str, index: int, *, token: Optional[str], join_timeout: float,
                 binding: Optional[_addresses.Binding], store_address: Optional[str], incarnation: int,
                 launch_id: Optional[str] = None):
        self.cluster, self.job, self.index = cluster, job, index
        self.name = task_name(job, index)
        self.address = cluster.task_address(job, index)
        self.token, self.binding, self.store_address = token, binding, store_address
        self.join_timeout = join_timeout  # the store's own timeout, and what a gave-up message cites
        self.incarnation = incarnation  # claim_slot raises it when it takes over from a dead holder
        self.launch_id = launch_id  # the launcher that started this task, if one did (taskenv.ENV_LAUNCH_ID)
        self.store = None
        self.records = None  # the EtcdStore under `store`, whose records outlive the run; None for a TCPStore
        self.nonce: Optional[str] = None
        self.hosts_store = False  # this task serves the store: it must outlive everyone's leave
        self.port = binding.port if binding is not None else None  # held port: the system's pick for port 0
        self._sock: Optional[socket.socket] = None  # holds this task's address while another hosts the store

    def key(self, kind: str, job: Optional[str] = None, index: Optional[int] = None) -> str:
        """The store key of a task's `kind` of entry ('slot', 'up', 'beat', 'done', ...), this task's
        unless `job` and `index` say otherwise."""
        return f"{kind}/{self.job if job is None else job}/{self.index if index is None else index}"

    def mark(self, kind: str) -> None:
        """Say in the store that this task has reached `kind` ('done', 'left', ...)."""
        self.store.set(self.key(kind), "1")

    def is_marked(self, kind: str, job: Optional[str] = None, index: Optional[int] = None) -> bool:
        return self.store.check([self.key(kind, job, index)])

    def meet(self, deadline: float, host: bool) -> None:
        """Host (`host`) or join the store, claim this task's slot, and wait until every task holds
        its own. A restarted incarnation whose cluster has ended exits here (ending.rejoin_or_exit)."""
        if host:
            self.host()
        else:
            self.join(deadline)
        self.claim_slot()
        _ending.rejoin_or_exit(self)  # a restarted incarnation whose earlier one had finished: see ending.py
        self.wait_for_all("slot", deadline, "tasks up")

    # --- opening the store -------------------------------------------------------------------

    def host(self) -> None:
        """Serve the store at this task's address (the coordinator, when no launcher hosts one)."""
        try:
            sock = _c10d.listen(self.binding.host, self.binding.port)
        except OSError as e:
            raise self._bind_error(e, port_taken_by=None) from None
        self.port = sock.getsockname()[1]
        self.store, self.nonce = _stores.serve_store(sock, self.cluster, self.token, self.name, self.join_timeout)
        self.hosts_store = True

    def _bind_error(self, e: OSError, port_taken_by: Optional[dict]) -> ClusterJoinError:
        host, port = split_address(self.address, any_port=True)
        if e.errno == errno.EADDRINUSE:
            if port_taken_by:
                return _slot_taken(self.name, port_taken_by)
            return ClusterJoinError(
                f"port {port} of {self.name} ({self.address!r}) is already in use — by another program, or by "
                f"another task started as {self.name}. Free the port (`ss -ltnp 'sport = :{port}'` shows who "
                "holds it) or give this task another address in the cluster spec.",
                task=self.name,
            )
        return ClusterJoinError(
            f"cannot listen on {self.address!r} for {self.name}: {e.strerror or e}. The address must belong to "
            "the machine this task runs on.",
            task=self.name,
        )

    def join(self, deadline: float) -> None:
        """Join the store (etcd, the launcher's, else the coordinator's) by `deadline` and check its publisher."""
        bind_error = None
        if self.binding is not None:  # None: a torchrun-named rank, whose entry is not its own address
            try:
                self._sock = _c10d.listen(self.binding.host, self.binding.port)
                self.port = self._sock.getsockname()[1]
            except OSError as e:
                bind_error = e
        if etcd_url.is_etcd_url(self.store_address):
            self.store, self.records = _stores.open_etcd(self.store_address, self.cluster, self.join_timeout,
                                                         max(1.0, deadline - time.monotonic()), self.name)
            _ending.exit_if_run_ended(self)  # a restart after its run's keys expired: see ending.py
            info = _stores.publish_or_read(self.store, self.cluster, self.token, self.name)[0]
        else:
            info = self._join_hosted(deadline, bind_error)
        if bind_error is not None:
            taken = self.is_marked("slot") and json.loads(self.store.get(self.key("slot")))
            raise self._bind_error(bind_error, taken or None)
        self._check_publisher(info)
        self.nonce = info["nonce"]
        _ending.remember_run(self)

    def _join_hosted(self, deadline: float, bind_error: Optional[OSError]) -> dict:
        """Connect to the store the launcher or the coordinator serves, once it listens; its publisher record."""
        if self.store_address is not None:
            c_address, c_name = self.store_address, "the launcher's rendezvous store"
            c_host, c_port = split_address(c_address)
        else:
            coordinator = self.cluster.coordinator()
            c_address = self.cluster.task_address(coordinator.job, coordinator.task)
            c_name = task_name(coordinator.job, coordinator.task)
            c_host, c_port = split_address(c_address)
            c_host = _addresses.dial_host(self.cluster, c_host)
        n = len(self.cluster.tasks())
        said = time.monotonic() - SAY_EVERY + 1.0  # first message after a second of waiting
        while not _c10d.port_is_open(c_host, c_port):
            now = time.monotonic()
            if bind_error is not None:
                raise self._bind_error(bind_error, None)
            if now > deadline:
                raise ClusterTimeoutError(
                    f"{self.name} gave up after {self.join_timeout:g} s: the coordinator {c_name} at {c_address} never "
                    f"came up (missing: {c_name} at {c_address}; the other tasks cannot be counted without it). Start "
                    f"it, or raise the timeout with {_taskenv.ENV_JOIN_TIMEOUT}.",
                    task=self.name,
                    missing=[c_name],
                )
            if now - said >= SAY_EVERY:
                _log.get("cluster", self.name).info(f"waiting for {c_name} at {c_address} — 1 of {n} tasks up")
                said = now
            time.sleep(POLL * random.uniform(0.5, 1.5))  # the tasks of a cluster started at once knock apart
        store = _c10d.connect_store(c_host, c_port, max(1.0, deadline - time.monotonic()))
        self.store = _c10d.prefix_store("towerflow", store)
        return json.loads(self._get(_stores.PUBLISHER_KEY, deadline, c_name, c_address))

    def _check_publisher(self, info: dict) -> None:
        """Refuse a store published for another cluster spec or with another token."""
        if info["fingerprint"] != self.cluster.fingerprint():
            raise ClusterJoinError(
                f"{self.name} has a different cluster spec from the coordinator {info['task']}: this task has "
                f"{self.cluster.as_dict()}, the coordinator has {info['cluster']}. Start every task with the same spec.",
                task=self.name,
            )
        if info["has_token"] and self.token is None:
            raise ClusterJoinError(
                f"{self.name} was refused: the cluster requires a token and this task has none. Set "
                f"{_taskenv.ENV_CLUSTER_TOKEN} (or {_taskenv.ENV_CLUSTER_TOKEN_FILE}) to the cluster's token.",
                task=self.name,
            )
        if not info["has_token"] and self.token is not None:
            raise ClusterJoinError(
                f"{self.name} was refused: it has a cluster token but the coordinator {info['task']} has none. Give "
                f"every task the same {_taskenv.ENV_CLUSTER_TOKEN}, or none.",
                task=self.name,
            )
        if not hmac.compare_digest(info["proof"], proof(self.token, info["nonce"], "coordinator")):
            raise ClusterJoinError(
                f"{self.name} was refused: wrong cluster token (it does not match the coordinator {info['task']}'s). "
                f"Check {_taskenv.ENV_CLUSTER_TOKEN} / {_taskenv.ENV_CLUSTER_TOKEN_FILE} on this task.",
                task=self.name,
            )

    def _get(self, key: str, deadline: float, who: str, where: str) -> bytes:
        wait_until(lambda: self.store.check([key]), deadline - time.monotonic(),
                   f"{self.name}: {who} at {where} accepted a connection but never published the cluster", POLL,
                   lambda text: ClusterTimeoutError(text, task=self.name, missing=[who]))
        return self.store.get(key)

    # --- the slot ----------------------------------------------------------------------------

    def claim_slot(self) -> None:
        """Hold this task's slot; a restarted incarnation takes over a dead holder's (and a first
        start whose holder is dead counts as one more incarnation of it)."""
        def claim() -> str:
            return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "incarnation": self.incarnation,
                               "proof": proof(self.token, self.nonce, self.name)})

        mine = claim()
        held = self.store.compare_set(self.key("slot"), "", mine).decode()
        if held != mine:  # taken: by a dead incarnation of this task, this one takes over
            other = json.loads(held)
            previous = other.get("incarnation", 0)
            if (previous < self.incarnation or self.incarnation == 0) and self._holder_is_dead(other):
                # incarnation 0 here: a new launcher on a host that lost every process, not a restart by ours
                self.incarnation = max(self.incarnation, previous + 1)
                mine = claim()
                held = self.store.compare_set(self.key("slot"), held, mine).decode()
        if held != mine:
            other = json.loads(held)
            if self.incarnation > 0:
                raise ClusterJoinError(
                    f"{self.name} (restart {self.incarnation}) cannot take over its slot: the process holding it (pid "
                    f"{other.get('pid')} on {other.get('host')}, incarnation {other.get('incarnation', 0)}) is still "
                    "alive and beating. Stop it first; a restarted task replaces only a dead one.",
                    task=self.name,
                )
            raise _slot_taken(self.name, other)

    def _holder_is_dead(self, holder: dict) -> bool:
        """Whether the process that holds this slot is gone: on this host by its pid, elsewhere by
        its heartbeat standing still for three beats."""
        if holder.get("host") == socket.gethostname() and holder.get("pid"):
            try:
                os.kill(int(holder["pid"]), 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            try:
                with open(f"/proc/{int(holder['pid'])}/stat") as f:  # a zombie is dead too
                    return f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:  # gone since the check
                return True
            except OSError:  # no /proc here: alive as far as we can tell
                return False
        key = self.key("beat")
        before = self.store.add(key, 0)
        time.sleep(3 * BEAT_EVERY)
        return self.store.add(key, 0) == before

    # --- waiting for the others --------------------------------------------------------------

    def wait_for_all(self, kind: str, deadline: float, what: str) -> None:
        """Wait until every task has set its `kind` key; past `deadline`, raise naming the missing."""
        tasks = self.cluster.tasks()
        said = time.monotonic() - SAY_EVERY + 1.0  # first message after a second of waiting
        missing = list(tasks)  # a key once set stays set while tasks join: only the missing are asked again
        while True:
            missing = self.unmarked(kind, missing)
            if not missing:
                return
            now = time.monotonic()
            if now > deadline or now - said >= SAY_EVERY:  # all of them asked and named only then: hundreds of
                missing = self.unmarked(kind, missing, all_of_them=True)  # tasks poll ten times a second
                if not missing:
                    return
                names = [f"{task_name(t.job, t.task)} at {self.cluster.task_address(t.job, t.task)}" for t in missing]
                if now > deadline:
                    raise ClusterTimeoutError(
                        f"{self.name} gave up after {self.join_timeout:g} s with {len(tasks) - len(missing)} of "
                        f"{len(tasks)} {what}; missing: {', '.join(names)}. Start the missing tasks, or raise the "
                        f"timeout with {_taskenv.ENV_JOIN_TIMEOUT}.",
                        task=self.name,
                        missing=[task_name(t.job, t.task) for t in missing],
                    )
                _log.get("cluster", self.name).info(f"waiting for {names[0]} — {len(tasks) - len(missing)} of {len(tasks)} {what}")
                said = now
            time.sleep(POLL)

    def unmarked(self, kind: str, tasks, all_of_them: bool = False) -> list:
        """The tasks (of `tasks`, in order) whose `kind` key is not set yet, asked in windows: the first
        CHECK_WINDOW keys in one call, and while every key of a window is set the next, twice as long (a poll
        when all are set costs a few calls). The first window with an unset key ends the poll: it and the rest
        are returned, to be asked again next time, so a waiting task's poll is one call; only `all_of_them` (to
        name the missing) asks their keys one by one. Every task waiting polls ten times a second: asking each
        time about every key still missing would make the store read N²/4 keys per poll round while a large
        cluster joins, and walking a window key by key up to its first unset one would cost a call for each key
        set since the last poll (tasks come up in any order)."""
        start, size = 0, CHECK_WINDOW
        while start < len(tasks):
            window = tasks[start:start + size]
            if not self.store.check([self.key(kind, t.job, t.task) for t in window]):
                if all_of_them:
                    return [t for t in tasks[start:] if not self.is_marked(kind, t.job, t.task)]
                return list(tasks[start:])
            start, size = start + len(window), 2 * size
        return []

    def wait_for_others(self, kind: str, seconds: float, absent: Collection[Tuple[str, int]] = ()) -> None:
        """Wait (at most `seconds`) until every other task, but those (job, index) `absent`, has set its `kind` key."""
        others = [t for t in self.cluster.tasks() if (t.job, t.task) != (self.job, self.index)
                  and (t.job, t.task) not in absent]
        def all_marked() -> bool:
            others[:] = self.unmarked(kind, others)
            return not others

        wait_until(all_marked, seconds, "", POLL, on_timeout=None)

    # --- facts -------------------------------------------------------------------------------

    def publish(self, key: str, value: str) -> None:
        """Record a small fact every task can read (`lookup`); it lives in the rendezvous store, so it
        outlives the task that wrote it (a ps strategy notes there which workers have finished)."""
        self.store.set(f"facts/{key}", value)

    def lookup(self, key: str) -> Optional[str]:
        """A fact some task `publish`ed, or None."""
        full = f"facts/{key}"
        return self.store.get(full).decode() if self.store.check([full]) else None

    def swap(self, key: str, expected: str, desired: str) -> str:
        """Set a fact to `desired` only while it holds `expected` ("": absent), in one store step; the value it
        holds after (`desired`, or what another task set first)."""
        return self.store.compare_set(f"facts/{key}", expected, desired).decode()

    def close(self) -> None:
        """Let go of the store and of this task's address."""
        self.store = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
