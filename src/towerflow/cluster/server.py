"""Server: one task of a cluster, as `tf.train.Server(cluster, job_name, task_index)`.

Starting a server holds the task's address, finds the rendezvous store (hosted by the
launcher for a local cluster, so that it outlives any task; otherwise by the coordinator,
the first task in rank order, at its own address), checks that this task has the same
cluster spec and token as the store's publisher, claims its slot, waits until every task has
done the same, then joins the RPC group that remote calls use. `join()` blocks until every
task is done (what a ps does) and then leaves cleanly.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from towerflow.cluster import addresses as _addresses
from towerflow.cluster import ending as _ending
from towerflow.cluster import environment as _env
from towerflow.cluster import failures as _failures
from towerflow.cluster import transport as _transport
from towerflow.cluster.spec import ClusterLike, ClusterSpec, split_address
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import ClusterError, ClusterJoinError, ClusterSpecError, ClusterTimeoutError, PeerLostError

DEFAULT_JOIN_TIMEOUT = _env.DEFAULT_JOIN_TIMEOUT
_SAY_EVERY = 5.0  # seconds between repeated waiting messages
_POLL = 0.1
_BEAT_EVERY = 1.0  # each task bumps its heartbeat counter in the store this often
DEFAULT_HEARTBEAT_TIMEOUT = _env.DEFAULT_HEARTBEAT_TIMEOUT

_current: Optional["Server"] = None  # this process's server; one per process, as in TF
_current_lock = threading.Lock()


def current() -> Optional["Server"]:
    """The started server of this process, or None."""
    return _current


def rpc_name(job: str, index: int, incarnation: int = 0) -> str:
    """The RPC name of one incarnation of a task (a restarted task joins under a new name: torch's
    RPC refuses a name twice). Callers address a task through `Server.rpc_name_of`, which finds
    the current incarnation."""
    return f"{job}:{index}" if incarnation == 0 else f"{job}:{index}:r{incarnation}"


def _int_from_env(name: str) -> int:
    text = os.environ.get(name) or "0"
    if not text.isdigit():
        raise ClusterSpecError(f"{name}={text!r} in the environment: expected a non-negative integer (the launcher sets it)")
    return int(text)


def _rpc_transports_from_env() -> tuple:
    raw = os.environ.get(_env.ENV_RPC_TRANSPORTS, "").strip()
    if not raw:
        return _transport.DEFAULT_RPC_TRANSPORTS
    return _transport.check_rpc_transports([n.strip() for n in raw.split(",")], _env.ENV_RPC_TRANSPORTS)


def _say(text: str) -> None:
    print(f"towerflow: {text}", file=sys.stderr, flush=True)


def _task_name(job: str, index: int) -> str:
    return f"/job:{job}/task:{index}"


def _proof(token: Optional[str], nonce: str, what: str) -> str:
    return hmac.new((token or "").encode(), f"{nonce}:{what}".encode(), hashlib.sha256).hexdigest()


def _serve_store(sock: socket.socket, cluster: ClusterSpec, token: Optional[str], host_name: str, timeout: float):
    """Serve the rendezvous store on a listening socket and publish the cluster in it; returns (store, nonce)."""
    store = _transport.prefix_store("towerflow", _transport.host_store(sock, timeout))
    nonce = secrets.token_hex(16)
    store.set(
        "coordinator",
        json.dumps(
            {
                "task": host_name,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "cluster": cluster.as_dict(),
                "fingerprint": cluster.fingerprint(),
                "has_token": token is not None,
                "nonce": nonce,
                "proof": _proof(token, nonce, "coordinator"),
            }
        ),
    )
    return store, nonce


def host_rendezvous(cluster: ClusterLike, token: Optional[str], address: str, timeout: float = DEFAULT_JOIN_TIMEOUT):
    """Host a cluster's rendezvous store outside its tasks (what `towerflow launch` does for a local
    cluster), so that it outlives any task: a killed chief can then be restarted and rejoin.

    Tasks find it through TOWERFLOW_STORE=address. Returns the store; it serves while referenced.
    """
    cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
    host, port = split_address(address)
    try:
        sock = _transport.listen(host, port)
    except OSError as e:
        raise ClusterJoinError(f"cannot host the rendezvous store at {address!r}: {e.strerror or e}") from None
    return _serve_store(sock, cluster, token, f"towerflow launch (pid {os.getpid()})", timeout)[0]


class Server:
    """One task of a cluster: holds its address, joins the others, serves remote calls.

    `Server()` with no arguments finds its task from the seeds' flags in sys.argv
    (`--ps_hosts ... --job_name ps --task_index 0`), TF_CONFIG / TOWERFLOW_* (set by
    `towerflow launch`) or torchrun's variables.
    """

    def __init__(
        self,
        cluster: Optional[ClusterLike] = None,
        job_name: Optional[str] = None,
        task_index: Optional[int] = None,
        *,
        token: Optional[str] = None,
        join_timeout: Optional[float] = None,
        rpc_timeout: float = 0,
        start: bool = True,
        argv: Optional[Sequence[str]] = None,
    ):
        source = "arguments"
        if cluster is None:
            info = _env.read_task(list(sys.argv[1:]) if argv is None else argv)
            cluster, job_name, task_index, source = info.cluster, job_name or info.job_name, (
                info.task_index if task_index is None else task_index
            ), info.source
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        if job_name is None:
            if len(self.cluster.jobs) != 1:
                raise ClusterSpecError(
                    f"job_name is required for a cluster with jobs {self.cluster.jobs}; pass e.g. "
                    f"Server(cluster, job_name={self.cluster.jobs[0]!r}, task_index=0)"
                )
            job_name = self.cluster.jobs[0]
        self.job_name = job_name
        self.task_index = 0 if task_index is None else task_index
        self.address = self.cluster.task_address(self.job_name, self.task_index)  # validates job and index
        # torchrun names the ranks after MASTER_ADDR (spec.from_torchrun): only rank 0's entry is its own
        self.binding: Optional[_addresses.Binding] = None
        if source != "torchrun" or self.is_coordinator:
            self.binding = _addresses.binding_for(self.cluster, self.job_name, self.task_index)
        self.token = _env.read_token(token)
        self.join_timeout = float(join_timeout) if join_timeout is not None else _env.join_timeout()
        self.rpc_timeout = rpc_timeout
        self._store = None
        self._store_address = os.environ.get(_env.ENV_STORE) or None  # the launcher's store, when it hosts one
        self._hosts_store = False
        self._sock: Optional[socket.socket] = None
        self._started = False
        self._stopped = False
        self._beating = threading.Event()
        self._beat_thread: Optional[threading.Thread] = None
        self.heartbeat_timeout = _env.heartbeat_timeout()
        self.rpc_transports = _rpc_transports_from_env()
        self.incarnation = _int_from_env(_env.ENV_RESTART_COUNT)  # 0, or how often the launcher restarted this task
        self.max_restarts = _int_from_env(_env.ENV_MAX_RESTARTS)  # a silent task may come back while below this
        self.replaced: List[str] = []  # RPC names of dead incarnations this one took over from
        self._incarnations: Dict[tuple, int] = {}
        if start:
            self.start()

    # --- what TF's Server exposes ---------------------------------------------------------

    @property
    def target(self) -> str:
        """Where this task listens, as TF's `server.target` ('grpc://...') but with towerflow's scheme."""
        return f"towerflow://{self.address}"

    @property
    def task(self) -> DeviceSpec:
        return DeviceSpec(job=self.job_name, replica=0, task=self.task_index)

    @property
    def name(self) -> str:
        return _task_name(self.job_name, self.task_index)

    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has no chief (TF's rule)."""
        if "chief" in self.cluster.jobs:
            return self.job_name == "chief" and self.task_index == 0
        return self.job_name == "worker" and self.task_index == 0

    @property
    def is_coordinator(self) -> bool:
        c = self.cluster.coordinator()
        return (c.job, c.task) == (self.job_name, self.task_index)

    @classmethod
    def create_local_server(cls, **kwargs) -> "Server":
        """TF's `tf.train.Server.create_local_server()`: a one-task cluster on a free loopback port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return cls({"localhost": [f"localhost:{port}"]}, "localhost", 0, **kwargs)

    @staticmethod
    def local_name() -> str:
        """This process's task as '/job:worker/task:1' ('/job:localhost/task:0' outside a cluster)."""
        from towerflow.devices.logical import local_task

        here = local_task()
        return _task_name(here.job, here.task)

    # --- starting --------------------------------------------------------------------------

    def start(self) -> "Server":
        """Join the cluster; waits (saying for whom) until every task is up or the timeout passes."""
        global _current
        if self._started:
            return self
        with _current_lock:
            if _current is not None and _current is not self and not _current._stopped:
                raise ClusterError(
                    f"this process already runs {_current.name}; one Server per process (as in TF)", task=self.name
                )
            _current = self
        self._set_local_task()
        _failures.install()  # a failure to join is reported to the launcher like any other
        deadline = time.monotonic() + self.join_timeout
        try:
            if self.is_coordinator and self._store_address is None:
                self._host()
            else:
                self._join_coordinator(deadline)
            self._claim_slot()
            _ending.rejoin_or_exit(self)  # a restarted incarnation whose earlier one had finished: see ending.py
            self._wait_for_all("slot", deadline, "tasks up")
            me = rpc_name(self.job_name, self.task_index, self.incarnation)
            if self.incarnation == 0:
                _transport.start_rpc(self._store, me, self._rank(), self.rpc_timeout, transports=self.rpc_transports)
            else:
                dead = [rpc_name(self.job_name, self.task_index, k) for k in range(self.incarnation)]
                self.replaced = _transport.start_rpc_replacing(self._store, me, self._rank(), self.rpc_timeout, dead,
                                                               transports=self.rpc_transports)
            self._store.add(self._key("beat"), 1)  # a first beat before the new incarnation shows (see _check_heartbeats)
            self._store.set(self._key("incarnation"), str(self.incarnation))
            self._store.set(self._key("up"), "1")
            self._start_heartbeat()
            self._wait_for_all("up", deadline, "tasks connected")
        except BaseException:
            self._close(graceful=False)
            raise
        self._started = True
        self._install_exit_hooks()
        if self.incarnation > 0:
            _say(f"{self.name} rejoined the cluster (restart {self.incarnation}) as RPC member {me}; "
                 f"dropped the dead {self.replaced or 'none'}")
        return self

    def _set_local_task(self) -> None:
        from towerflow.devices.logical import set_local_task

        set_local_task(self.job_name, self.task_index)  # device names and cached placements follow
        if self.binding is not None:  # RPC (and any process group) on the interface of this task's address
            for name, value in self.binding.socket_environment().items():
                os.environ.setdefault(name, value)

    def _rank(self) -> int:
        # each incarnation needs its own RPC rank too: torch keeps a dead member's id taken
        return self.cluster.rank_of(self.job_name, self.task_index) + self.incarnation * len(self.cluster.tasks())

    def rpc_name_of(self, job: str, index: int) -> str:
        """The RPC name of a task's current incarnation (from the store; a task that was restarted
        joined under a new name)."""
        if self._store is not None:
            self._incarnations[(job, index)] = self._incarnation_of(job, index)
        return rpc_name(job, index, self._incarnations.get((job, index), 0))

    def _incarnation_of(self, job: str, index: int) -> int:
        """How many times the task has been restarted, as its current incarnation wrote in the store."""
        key = self._key("incarnation", job, index)
        return int(self._store.get(key).decode()) if self._store.check([key]) else 0

    def publish(self, key: str, value: str) -> None:
        """Record a small fact every task can read (`lookup`); it lives in the rendezvous store, so it
        outlives the task that wrote it (a ps strategy notes there which workers have finished)."""
        self._store.set(f"facts/{key}", value)

    def lookup(self, key: str) -> Optional[str]:
        """A fact some task `publish`ed, or None."""
        full = f"facts/{key}"
        return self._store.get(full).decode() if self._store.check([full]) else None

    def wait_for_restart(self, job: str, index: int, lost: str, cause: str, timeout: Optional[float] = None) -> str:
        """Wait until task (job, index), whose incarnation named `lost` is gone, has been restarted
        and joined again; returns the new incarnation's RPC name.

        Raises PeerLostError at once when the launcher will not restart it (no restarts left), and
        ClusterTimeoutError when it is not back within `timeout` (default: heartbeat + join timeouts).
        """
        name = _task_name(job, index)
        limit = self.heartbeat_timeout + self.join_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            current = self.rpc_name_of(job, index)
            if current != lost:
                return current
            incarnation = self._incarnations[(job, index)]
            if incarnation >= self.max_restarts:
                failed = _failures.failure_of(self._store, job, index)
                if failed is not None:  # it stopped on an error: that is the news
                    raise PeerLostError(f"{self.name} lost {name}, which {failed.summary}", task=name)
                raise PeerLostError(
                    f"{self.name} lost {name} ({cause}), and it will not be restarted ({incarnation} of "
                    f"{self.max_restarts} restarts used). Launch with --max-restarts N: the launcher then restarts a "
                    "lost task and training goes on.",
                    task=name,
                )
            now = time.monotonic()
            if now > deadline:
                raise ClusterTimeoutError(
                    f"{self.name} lost {name} ({cause}) and it was not back within {limit:g} s "
                    f"({_env.ENV_HEARTBEAT_TIMEOUT} + {_env.ENV_JOIN_TIMEOUT}); is the launcher of its host still running?",
                    task=self.name,
                    missing=[name],
                )
            time.sleep(_POLL)

    def _key(self, kind: str, job: Optional[str] = None, index: Optional[int] = None) -> str:
        job = self.job_name if job is None else job
        index = self.task_index if index is None else index
        return f"{kind}/{job}/{index}"

    def _host(self) -> None:
        try:
            sock = _transport.listen(self.binding.host, self.binding.port)
        except OSError as e:
            raise self._bind_error(e, port_taken_by=None) from None
        self._store, self._nonce = _serve_store(sock, self.cluster, self.token, self.name, self.join_timeout)
        self._hosts_store = True

    def _bind_error(self, e: OSError, port_taken_by: Optional[dict]) -> ClusterJoinError:
        host, port = split_address(self.address)
        if e.errno == errno.EADDRINUSE:
            if port_taken_by:
                return ClusterJoinError(
                    f"{self.name} is already taken by another process (pid {port_taken_by.get('pid')} on "
                    f"{port_taken_by.get('host')}); a slot holds one task. Stop the other one, or start this one "
                    "with a free --task_index.",
                    task=self.name,
                )
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

    def _join_coordinator(self, deadline: float) -> None:
        bind_error = None
        if self.binding is not None:  # None: a torchrun-named rank, whose entry is not its own address
            try:
                self._sock = _transport.listen(self.binding.host, self.binding.port)
            except OSError as e:
                bind_error = e
        if self._store_address is not None:
            c_address, c_name = self._store_address, "the launcher's rendezvous store"
            c_host, c_port = split_address(c_address)
        else:
            coordinator = self.cluster.coordinator()
            c_address = self.cluster.task_address(coordinator.job, coordinator.task)
            c_name = _task_name(coordinator.job, coordinator.task)
            c_host, c_port = split_address(c_address)
            c_host = _addresses.dial_host(self.cluster, c_host)
        n = len(self.cluster.tasks())
        said = time.monotonic() - _SAY_EVERY + 1.0  # first message after a second of waiting
        while not _transport.port_is_open(c_host, c_port):
            now = time.monotonic()
            if bind_error is not None:
                raise self._bind_error(bind_error, None)
            if now > deadline:
                raise ClusterTimeoutError(
                    f"{self.name} gave up after {self.join_timeout:g} s: the coordinator {c_name} at {c_address} never "
                    f"came up (missing: {c_name} at {c_address}; the other tasks cannot be counted without it). Start "
                    f"it, or raise the timeout with {_env.ENV_JOIN_TIMEOUT}.",
                    task=self.name,
                    missing=[c_name],
                )
            if now - said >= _SAY_EVERY:
                _say(f"{self.name}: waiting for {c_name} at {c_address} — 1 of {n} tasks up")
                said = now
            time.sleep(_POLL)
        store = _transport.connect_store(c_host, c_port, max(1.0, deadline - time.monotonic()))
        self._store = _transport.prefix_store("towerflow", store)
        info = json.loads(self._get("coordinator", deadline, c_name, c_address))
        if bind_error is not None:
            taken = self._store.check([self._key("slot")]) and json.loads(self._store.get(self._key("slot")))
            raise self._bind_error(bind_error, taken or None)
        if info["fingerprint"] != self.cluster.fingerprint():
            raise ClusterJoinError(
                f"{self.name} has a different cluster spec from the coordinator {info['task']}: this task has "
                f"{self.cluster.as_dict()}, the coordinator has {info['cluster']}. Start every task with the same spec.",
                task=self.name,
            )
        if info["has_token"] and self.token is None:
            raise ClusterJoinError(
                f"{self.name} was refused: the cluster requires a token and this task has none. Set "
                f"{_env.ENV_CLUSTER_TOKEN} (or {_env.ENV_CLUSTER_TOKEN_FILE}) to the cluster's token.",
                task=self.name,
            )
        if not info["has_token"] and self.token is not None:
            raise ClusterJoinError(
                f"{self.name} was refused: it has a cluster token but the coordinator {info['task']} has none. Give "
                f"every task the same {_env.ENV_CLUSTER_TOKEN}, or none.",
                task=self.name,
            )
        if not hmac.compare_digest(info["proof"], _proof(self.token, info["nonce"], "coordinator")):
            raise ClusterJoinError(
                f"{self.name} was refused: wrong cluster token (it does not match the coordinator {info['task']}'s). "
                f"Check {_env.ENV_CLUSTER_TOKEN} / {_env.ENV_CLUSTER_TOKEN_FILE} on this task.",
                task=self.name,
            )
        self._nonce = info["nonce"]

    def _get(self, key: str, deadline: float, who: str, where: str) -> bytes:
        while not self._store.check([key]):
            if time.monotonic() > deadline:
                raise ClusterTimeoutError(
                    f"{self.name}: {who} at {where} accepted a connection but never published the cluster",
                    task=self.name,
                    missing=[who],
                )
            time.sleep(_POLL)
        return self._store.get(key)

    def _claim_slot(self) -> None:
        def claim() -> str:
            return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "incarnation": self.incarnation,
                               "proof": _proof(self.token, self._nonce, self.name)})

        mine = claim()
        held = self._store.compare_set(self._key("slot"), "", mine).decode()
        if held != mine:  # taken: by a dead incarnation of this task, this one takes over
            other = json.loads(held)
            previous = other.get("incarnation", 0)
            if (previous < self.incarnation or self.incarnation == 0) and self._holder_is_dead(other):
                # incarnation 0 here: a new launcher on a host that lost every process, not a restart by ours
                self.incarnation = max(self.incarnation, previous + 1)
                mine = claim()
                held = self._store.compare_set(self._key("slot"), held, mine).decode()
        if held != mine:
            other = json.loads(held)
            if self.incarnation > 0:
                raise ClusterJoinError(
                    f"{self.name} (restart {self.incarnation}) cannot take over its slot: the process holding it (pid "
                    f"{other.get('pid')} on {other.get('host')}, incarnation {other.get('incarnation', 0)}) is still "
                    "alive and beating. Stop it first; a restarted task replaces only a dead one.",
                    task=self.name,
                )
            raise ClusterJoinError(
                f"{self.name} is already taken by another process (pid {other.get('pid')} on {other.get('host')}); "
                "a slot holds one task. Stop the other one, or start this one with a free --task_index.",
                task=self.name,
            )

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
        key = self._key("beat")
        before = self._store.add(key, 0)
        time.sleep(3 * _BEAT_EVERY)
        return self._store.add(key, 0) == before

    def _wait_for_all(self, kind: str, deadline: float, what: str) -> None:
        tasks = self.cluster.tasks()
        said = time.monotonic() - _SAY_EVERY + 1.0  # first message after a second of waiting
        while True:
            missing = [t for t in tasks if not self._store.check([self._key(kind, t.job, t.task)])]
            if not missing:
                return
            now = time.monotonic()
            names = [f"{_task_name(t.job, t.task)} at {self.cluster.task_address(t.job, t.task)}" for t in missing]
            if now > deadline:
                raise ClusterTimeoutError(
                    f"{self.name} gave up after {self.join_timeout:g} s with {len(tasks) - len(missing)} of "
                    f"{len(tasks)} {what}; missing: {', '.join(names)}. Start the missing tasks, or raise the timeout "
                    f"with {_env.ENV_JOIN_TIMEOUT}.",
                    task=self.name,
                    missing=[_task_name(t.job, t.task) for t in missing],
                )
            if now - said >= _SAY_EVERY:
                _say(f"{self.name}: waiting for {names[0]} — {len(tasks) - len(missing)} of {len(tasks)} {what}")
                said = now
            time.sleep(_POLL)

    # --- stopping --------------------------------------------------------------------------

    def join(self, timeout: Optional[float] = None) -> None:
        """Block until every task of the cluster is done (has called join or exited), then leave.

        Raises PeerLostError naming the task when another task failed, and ClusterTimeoutError
        when `timeout` seconds pass first.
        """
        if self._stopped or not self._started:
            return
        self._store.set(self._key("done"), "1")
        deadline = None if timeout is None else time.monotonic() + timeout
        tasks = self.cluster.tasks()
        seen: Dict[str, tuple] = {}  # task -> (last heartbeat count, when it last changed)
        try:
            while True:
                for t in tasks:
                    failed = self._final_failure(t.job, t.task)
                    if failed is not None:
                        self._store.set(self._key("left"), "1")  # lets a failed coordinator stop waiting for us
                        raise PeerLostError(f"{failed.task} {failed.summary}", task=failed.task)
                missing = [t for t in tasks if not self._store.check([self._key("done", t.job, t.task)])]
                if not missing and _ending.try_end(self._store, [self._key("done", t.job, t.task) for t in tasks]):
                    break  # ended once for all: a restarted incarnation now finds it so and does not rejoin
                self._check_heartbeats(missing, seen)
                if deadline is not None and time.monotonic() > deadline:
                    raise ClusterTimeoutError(
                        f"{self.name}: tasks still running after {timeout:g} s: "
                        f"{', '.join(_task_name(t.job, t.task) for t in missing)}",
                        task=self.name,
                        missing=[_task_name(t.job, t.task) for t in missing],
                    )
                time.sleep(2 * _POLL)
        except ClusterError as e:
            _failures.record(e)  # say why before leaving: the others see this task gone and look for the reason
            self._close(graceful=False)
            raise
        except Exception as e:  # the store went away: the coordinator is gone
            self._close(graceful=False)
            c = self.cluster.coordinator()
            raise PeerLostError(f"{self.name} lost the cluster's coordinator while waiting for the others: {e}",
                                task=_task_name(c.job, c.task)) from None
        self._close(graceful=True)

    def check_peers(self, seen: Dict[str, tuple], serving: Sequence[str] = ()) -> None:
        """Raise PeerLostError when another task that has not finished failed, or has stopped beating
        for longer than it could take to come back (see `join`). Call it repeatedly with the same
        `seen` dict while waiting on other tasks, so that a dead one ends the wait instead of hanging it.
        Tasks of the jobs in `serving` (a worker waiting on the ps) are watched even once done."""
        me = (self.job_name, self.task_index)
        running = [t for t in self.cluster.tasks() if (t.job, t.task) != me and (
                   t.job in serving or not self._store.check([self._key("done", t.job, t.task)]))]
        for failed in filter(None, (self._final_failure(t.job, t.task) for t in running)):
            raise PeerLostError(f"{failed.task} {failed.summary}", task=failed.task)
        self._check_heartbeats(running, seen)

    def _final_failure(self, job: str, index: int):
        """The task's recorded failure, unless the launcher will restart it (restarts left): then it
        is a lost task like a killed one, and the heartbeat rules wait for its next incarnation."""
        failed = _failures.failure_of(self._store, job, index)
        if failed is None or self._incarnation_of(job, index) < self.max_restarts:
            return None
        return failed

    def wait_watching(self, future, serving: Sequence[str] = (), task: Optional[tuple] = None, every: float = 1.0) -> None:
        """Return once the torch `future` is done. Meanwhile watch heartbeats (of `task` = (job, index)
        only, or of every running task and the jobs in `serving`), so that a call to a task that died or
        was cut off by the network ends with ClusterError naming it instead of waiting forever."""
        if future.done():
            return
        ready = threading.Event()
        future.add_done_callback(lambda _f: ready.set())
        seen: Dict[str, tuple] = {}
        while not ready.wait(every):
            if task is not None:
                self._check_heartbeats([DeviceSpec(job=task[0], replica=0, task=task[1])], seen)
            else:
                self.check_peers(seen, serving)

    def _start_heartbeat(self) -> None:
        store, key = self._store, self._key("beat")

        def beat() -> None:
            while not self._beating.wait(_BEAT_EVERY):
                try:
                    store.add(key, 1)
                except Exception:  # the coordinator is gone; join() reports it
                    return

        self._beat_thread = threading.Thread(target=beat, name=f"towerflow-heartbeat {self.name}", daemon=True)
        self._beat_thread.start()

    def _check_heartbeats(self, running: List[DeviceSpec], seen: Dict[str, tuple]) -> None:
        """A task that stopped beating without saying it is done was killed or hangs: fail instead of waiting forever.

        A task the launcher may still restart (`--max-restarts`) gets the join timeout on top,
        the time a restarted task has to come back; its new incarnation beats the same counter.
        """
        now = time.monotonic()
        for t in running:
            name = _task_name(t.job, t.task)
            count = self._store.add(self._key("beat", t.job, t.task), 0)
            incarnation = self._incarnation_of(t.job, t.task)
            last = seen.get(name)
            if last is None or last[0] != (count, incarnation):  # a beat, or a restarted incarnation: alive again
                seen[name] = ((count, incarnation), now)
                continue
            silent = now - last[1]
            if silent <= self.heartbeat_timeout:
                continue
            may_restart = incarnation < self.max_restarts
            if may_restart and silent <= self.heartbeat_timeout + self.join_timeout:
                continue
            waited = (
                f"{silent:.0f} s (it may be restarted: {incarnation} of {self.max_restarts} restarts used, and "
                f"the wait includes {_env.ENV_JOIN_TIMEOUT}={self.join_timeout:g} s for it to come back)"
                if may_restart else f"{self.heartbeat_timeout:g} s"
            )
            raise PeerLostError(
                f"{name} at {self.cluster.task_address(t.job, t.task)} stopped answering: no heartbeat for "
                f"{waited} and it never finished. It was killed or is hung; restart the cluster, or launch with "
                f"--max-restarts N so the launcher restarts it (the wait is {_env.ENV_HEARTBEAT_TIMEOUT}).",
                task=name,
            )

    def abort(self, reason: str) -> None:
        """Tell the others this task failed (their join() raises with `reason`) and leave at once."""
        if self._stopped:
            return
        _failures.record(text=reason)  # keeps the record of the exception that led here, if there was one
        try:
            if self._store is not None and self._hosts_store:  # keep the store up until the others read why (or 3 s)
                self._wait_for_others("left", 3.0)
        except Exception:
            pass
        self._close(graceful=False)

    def _wait_for_others(self, kind: str, seconds: float) -> None:
        """Wait (at most `seconds`) until every other task has set its `kind` key."""
        others = [t for t in self.cluster.tasks() if (t.job, t.task) != (self.job_name, self.task_index)]
        end = time.monotonic() + seconds
        while time.monotonic() < end and not all(self._store.check([self._key(kind, t.job, t.task)]) for t in others):
            time.sleep(_POLL)

    def _close(self, graceful: bool) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._beating.set()
        if self._beat_thread is not None:
            self._beat_thread.join(2 * _BEAT_EVERY)
        try:
            if graceful:
                _transport.stop_rpc(graceful=True, everyone_leaving=lambda: _ending.leave_together(self))
                self._store.set(self._key("left"), "1")
                if self._hosts_store:  # the store must outlive everyone's leave
                    self._wait_for_others("left", 30.0)
            else:
                _transport.stop_rpc(graceful=False)
        except Exception:
            if _transport.is_rpc_running():
                _transport.stop_rpc(graceful=False)
        finally:
            _failures.detach(self._store)
            self._store = None
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.join()
        else:
            self.abort(_failures.record(exc).error)

    def _install_exit_hooks(self) -> None:
        # An uncaught exception is recorded as this task's failure (cluster/failures.py), so atexit
        # aborts instead of waiting on the others.
        _failures.attach(self._store)
        _failures.install()
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self._stopped:
            return
        failure = _failures.recorded()
        if failure is not None:
            self.abort(failure.error)
        else:
            self.join()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "started" if self._started else "not started"
        return f"Server({self.name} at {self.address}, {state})"
