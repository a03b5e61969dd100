"""Server: one task of a cluster, as `tf.train.Server(cluster, job_name, task_index)`.

Starting a server holds the task's address, meets the other tasks in the rendezvous store
(`rendezvous.py`: hosted by the launcher for a local cluster, else by the coordinator; same spec
and token checked, slot claimed, every task waited for), then serves remote calls (`messaging.py`,
its address published in the store) and starts beating (`membership.py`: heartbeats, restarted incarnations). `join()`
blocks until every task is done (what a ps does) and then leaves cleanly.

The façade takes its settings from the task environment (`towerflow.taskenv`); the rendezvous
and the membership get the values as arguments.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from towerflow import _log
from towerflow import library_env as _library_env
from towerflow import etcd_url
from towerflow import taskenv as _taskenv
from towerflow.cluster import addresses as _addresses
from towerflow.cluster.membership import ending as _ending
from towerflow.cluster import environment as _env
from towerflow.cluster import exit_hooks as _exit_hooks
from towerflow.cluster.membership import failures as _failures
from towerflow.cluster.calls.names import call_name
from towerflow.cluster.membership.membership import Membership
from towerflow.cluster.membership.rendezvous import Rendezvous, task_name
from towerflow.cluster.store.stores import host_rendezvous
from towerflow.cluster.spec import ClusterLike, ClusterSpec, split_address
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import ClusterError, ClusterSpecError, PeerLost

__all__ = ["Server", "current", "host_rendezvous"]

_current: Optional["Server"] = None  # this process's server; one per process, as in TF
_current_lock = threading.Lock()


def current() -> Optional["Server"]:
    """The started server of this process (None once it stopped)."""
    return _current if _current is not None and not _current._stopped else None


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
        start: bool = True,
        argv: Optional[Sequence[str]] = None,
        context: Optional[_taskenv.TaskContext] = None,
    ):
        source = "arguments"
        # this task's settings (timeouts, restarts, transports, the launcher's store): the entry point's context,
        # else built here from the environment
        env = context if context is not None else _taskenv.from_environment()
        if cluster is None:
            info = _env.read_task(list(sys.argv[1:]) if argv is None else argv, context=env)
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
        # torchrun and the bare env:// variables name the ranks after MASTER_ADDR (spec.from_torchrun): only
        # rank 0's entry is surely its own
        self.binding: Optional[_addresses.Binding] = None
        if source not in ("torchrun", "env") or self.is_coordinator:
            self.binding = _addresses.binding_for(self.cluster, self.job_name, self.task_index)
        self.token = token or env.join.cluster_token()
        self.join_timeout = float(join_timeout) if join_timeout is not None else env.join.join_timeout
        self.heartbeat_timeout = env.join.heartbeat_timeout
        from towerflow.cluster.calls.wire_security import WireSecurity  # zmq, for processes that are tasks only

        self.wire_security = WireSecurity(env.join.wire_security or self._default_wire_security(), self.token)
        self.context = env  # this task's resolved environment, handed to what runs in it (the ps client, the strategy)
        self.max_restarts = env.join.max_restarts
        restarts = env.identity.restart_count
        store_address = env.join.store  # the launcher's store, when it hosts one
        self.rendezvous = Rendezvous(self.cluster, self.job_name, self.task_index, token=self.token,
                                     join_timeout=self.join_timeout, binding=self.binding,
                                     store_address=store_address, incarnation=restarts, launch_id=env.identity.launch_id)
        self.membership = Membership(self.rendezvous, heartbeat_timeout=self.heartbeat_timeout,
                                     join_timeout=self.join_timeout, max_restarts=self.max_restarts)
        self.replaced: List[str] = []  # call names of dead incarnations this one took over from
        self._started = False
        self._stopped = False
        if start:
            self.start()

    # --- what TF's Server exposes ---------------------------------------------------------

    @property
    def target(self) -> str:
        """Where this task listens, as TF's `server.target` ('grpc://...') but with towerflow's scheme;
        for an entry with port 0, the port the started server got."""
        return f"towerflow://{self.address}"

    @property
    def task(self) -> DeviceSpec:
        return DeviceSpec(job=self.job_name, replica=0, task=self.task_index)

    @property
    def name(self) -> str:
        return task_name(self.job_name, self.task_index)

    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has no chief (TF's rule, `taskenv.is_chief_task`)."""
        return _taskenv.is_chief_task(self.job_name, self.task_index, self.cluster.jobs)

    @property
    def is_coordinator(self) -> bool:
        c = self.cluster.coordinator()
        return (c.job, c.task) == (self.job_name, self.task_index)

    @property
    def incarnation(self) -> int:
        """0, or how often the launcher restarted this task (claiming a dead holder's slot may raise it)."""
        return self.rendezvous.incarnation

    @classmethod
    def create_local_server(cls, **kwargs) -> "Server":
        """TF's `tf.train.Server.create_local_server()`: a one-task cluster at 'localhost:0', so the server
        binds a free port itself (`address` shows it once started) and no other process can take it first."""
        return cls({"localhost": ["localhost:0"]}, "localhost", 0, **kwargs)

    @staticmethod
    def local_name() -> str:
        """This process's task as '/job:worker/task:1' ('/job:localhost/task:0' outside a cluster)."""
        from towerflow.devices.logical import local_task

        here = local_task()
        return task_name(here.job, here.task)

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
        _log.configure(self.name)  # this task's diagnostics name it from here on
        _exit_hooks.install()  # a failure to join is reported to the launcher like any other
        _dump_stacks_on_sigusr1()
        deadline = time.monotonic() + self.join_timeout
        rv = self.rendezvous
        try:
            rv.meet(deadline, host=self.is_coordinator and rv.store_address is None)
            self._take_bound_port()
            self.replaced = self.membership.join_calls(self._serving_host(), self.wire_security, self.heartbeat_timeout)
            rv.wait_for_all("up", deadline, "tasks connected")
        except BaseException:
            self._close(graceful=False)
            raise
        self._started = True
        _exit_hooks.leave_at_exit(rv.store, abort=self.abort, join=self.join, task=self.context)
        if self.incarnation > 0:
            me = call_name(self.job_name, self.task_index, self.incarnation)
            _log.get("cluster", self.name).info(f"rejoined the cluster (restart {self.incarnation}) as {me}, in place of "
                f"{', '.join(self.replaced) or 'none'}")
        return self

    def _take_bound_port(self) -> None:
        """Port 0 in this task's entry: the port the system gave it becomes its address, as TF's
        `server.target` shows the bound port (the cluster spec keeps the entry as written)."""
        if self.binding is None or self.binding.port != 0:
            return
        host = split_address(self.address, any_port=True)[0]
        self.address = f"[{host}]:{self.rendezvous.port}" if ":" in host else f"{host}:{self.rendezvous.port}"
        self.binding = dataclasses.replace(self.binding, port=self.rendezvous.port)

    def _default_wire_security(self) -> str:
        """Encrypted as soon as the cluster spans more than this machine's loopback; authenticated on it."""
        if self.binding is not None:
            return "encrypt" if self.binding.multi_host else "authenticate"
        return "encrypt"  # a torchrun-named rank: its peers' addresses are not known yet

    def _serving_host(self) -> str:
        """The address this task serves remote calls on: its own entry's, else the one it reaches the store from."""
        if self.binding is not None:
            return self.binding.host
        c = self.cluster.coordinator()
        store = self.rendezvous.store_address
        if store is None or etcd_url.is_etcd_url(store):  # etcd: the route towards the coordinator's host
            store = self.cluster.task_address(c.job, c.task)
        return _addresses.route_source(_addresses.resolve(split_address(store)[0])[0])

    def _set_local_task(self) -> None:
        from towerflow.devices.logical import set_local_task

        set_local_task(self.job_name, self.task_index)  # device names and cached placements follow
        self.context = self.context.as_task(self.job_name, self.task_index)  # now naming this task
        if self.binding is not None:  # any process group on the interface of this task's address
            for name, value in self.binding.socket_environment().items():
                _library_env.set_default(name, value)

    # --- the others: facts, incarnations, liveness (see rendezvous.py and membership.py) -------

    def publish(self, key: str, value: str) -> None:
        """Record a small fact every task can read (`lookup`); it outlives the task that wrote it."""
        self.rendezvous.publish(key, value)

    def lookup(self, key: str) -> Optional[str]:
        """A fact some task `publish`ed, or None."""
        return self.rendezvous.lookup(key)

    def swap(self, key: str, expected: str, desired: str) -> str:
        """Set a fact to `desired` only while it holds `expected`, in one step; the value it holds after."""
        return self.rendezvous.swap(key, expected, desired)

    def call_name_of(self, job: str, index: int) -> str:
        """The call name of a task's current incarnation (a task that was restarted joined under a new name)."""
        return self.membership.call_name_of(job, index)

    def wait_for_restart(self, job: str, index: int, lost: str, cause: str, timeout: Optional[float] = None,
                         alive_ok: bool = False, beats_before: Optional[int] = None) -> str:
        """Wait until the task whose incarnation `lost` is gone is back; its new call name, or with `alive_ok` `lost`
        itself when that incarnation lives on (Membership.wait_for_restart)."""
        return self.membership.wait_for_restart(job, index, lost, cause, timeout, alive_ok, beats_before)

    def check_peers(self, seen: dict, serving: Sequence[str] = ()) -> None:
        """Raise PeerLost when another running task failed or went silent (Membership.check_peers)."""
        self.membership.check_peers(seen, serving)

    def peer_watch(self, serving: Sequence[str] = ()) -> Callable[[], None]:
        """A check to call repeatedly while waiting on others by other means: it raises PeerLost naming
        a task that failed or went silent (`Membership.check_peers`, with its memory of heartbeats)."""
        seen: Dict[str, tuple] = {}
        return lambda: self.membership.check_peers(seen, serving)

    def wait_watching(self, future, serving: Sequence[str] = (), task: Optional[tuple] = None, every: float = 1.0) -> None:
        """Wait for the torch `future` while watching the others' heartbeats (Membership.wait_watching)."""
        self.membership.wait_watching(future, serving, task, every)

    # --- stopping --------------------------------------------------------------------------

    def join(self, timeout: Optional[float] = None) -> None:
        """Block until every task of the cluster is done (has called join or exited), then leave.

        Raises PeerLost naming the task when another task failed, and ClusterTimeoutError
        when `timeout` seconds pass first.
        """
        if self._stopped or not self._started:
            return
        _ending.mark_done(self.rendezvous)
        try:
            self.membership.wait_until_all_done(timeout)
        except ClusterError as e:
            _failures.record(e)  # say why before leaving: the others see this task gone and look for the reason
            self._close(graceful=False)
            raise
        except Exception as e:  # the store went away: the coordinator is gone (or, etcd, no member answers)
            self._close(graceful=False)
            c = self.cluster.coordinator()
            lost = "store" if etcd_url.is_etcd_url(self.rendezvous.store_address) else "coordinator"
            raise PeerLost(f"{self.name} lost the cluster's {lost} while waiting for the others: {e}",
                                task=task_name(c.job, c.task)) from None
        self._close(graceful=True)

    def abort(self, reason: str) -> None:
        """Tell the others this task failed (their join() raises with `reason`) and leave at once."""
        if self._stopped:
            return
        _failures.record(text=reason)  # keeps the record of the exception that led here, if there was one
        try:
            if self.rendezvous.store is not None and self.rendezvous.hosts_store:
                self.rendezvous.wait_for_others("left", 3.0)  # keep the store up until the others read why (or 3 s)
        except Exception:
            pass
        self._close(graceful=False)

    def _close(self, graceful: bool) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.membership.stop()
        try:  # tasks another one stands in for (a ps host lost for good) will not leave with the others
            absent = self.membership.stood_in() if graceful else frozenset()
        except Exception:  # the store is out of reach: leave() finds so too
            absent = frozenset()
        _ending.leave(self.rendezvous, graceful, absent)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.join()
        else:
            self.abort(_failures.record(exc).error)

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "started" if self._started else "not started"
        return f"Server({self.name} at {self.address}, {state})"


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1` on a task (or on its launcher, which passes it on) prints every thread's stack to stderr: what a
    hung task is waiting for, without a debugger. Left alone when the program handles SIGUSR1 itself."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
        return
    for stream in (sys.stderr, sys.__stderr__):  # a captured stderr (pytest's) has no file descriptor
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both of the last two
            continue
