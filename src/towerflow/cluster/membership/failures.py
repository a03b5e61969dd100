"""Why a task stopped, recorded once, where its launcher and the other tasks can read it.

A task that dies of an uncaught exception records a `FailureRecord`: its own error (with its
traceback), or a consequence of losing another task (`PeerLost`, a remote call or gloo
connection that a gone peer closed). The record is made *before* the task lets go of anything
the others depend on, and the cluster's store numbers it (`failures/count`): whatever a failure
makes go wrong elsewhere is recorded after it, so the first failure is the own failure with the
lowest number — by cause, not by who happened to exit first. The task then

* writes a `FailureReport` (its record and the cluster's first failure as it reads it) to
  TOWERFLOW_ERROR_FILE, which `towerflow launch` reads for its verdict (`launch/verdict.py`), and
* publishes its record under `failed/<job>/<index>`, where `Server.join` and `wait_for_restart`
  of the others find it.

The store is the Server's, else the launcher's (TOWERFLOW_STORE), else the replicas' process
group's; without one, the record is not numbered and the launcher says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

from towerflow import etcd_url
from towerflow import taskenv as _taskenv
from towerflow.cluster.membership import numbered as _numbered
from towerflow.cluster.spec import split_address
from towerflow.errors import ClusterTimeoutError, ConnectionLost, PeerLost

ENV_ERROR_FILE = _taskenv.ENV_ERROR_FILE
BOARD_TIMEOUT = 5.0  # seconds the store gets to answer a failing task (it may be gone too)
_COUNT = "failures/count"


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """One task's failure: an error of its own (`cause` is None), or a consequence of losing
    `cause` (a task name, '' when the error does not say which peer)."""

    task: str  # '/job:worker/task:1' (or 'rank 1' for replicas outside a cluster)
    error: str  # one line: 'RuntimeError: injected failure at step 5'
    pid: int
    host: str
    time: float  # time.time() when it was recorded
    job: Optional[str] = None
    index: Optional[int] = None
    restart: int = 0  # the launcher's restart count of the task
    cause: Optional[str] = None
    traceback: str = ""
    seq: Optional[int] = None  # its number among the cluster's failures (None: no store to number it)

    @property
    def is_own(self) -> bool:
        return self.cause is None

    @property
    def summary(self) -> str:
        """'failed: RuntimeError: ...' for an own failure; 'stopped: <why>' for a consequence."""
        return f"failed: {self.error}" if self.is_own else f"stopped: {self.error.split(': ', 1)[-1]}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FailureRecord":
        return cls(**json.loads(text))


@dataclasses.dataclass(frozen=True)
class FailureReport:
    """What a failed task leaves its launcher in TOWERFLOW_ERROR_FILE."""

    failure: FailureRecord
    first: Optional[FailureRecord] = None  # the cluster's first own failure as this task read it

    def write(self, path: str) -> None:
        from towerflow._io import atomic_write

        body = {"failure": dataclasses.asdict(self.failure),
                "first": dataclasses.asdict(self.first) if self.first else None}
        with atomic_write(path, "w") as f:
            json.dump(body, f, indent=1)

    @classmethod
    def read(cls, path: str) -> "FailureReport":
        with open(path) as f:
            body = json.load(f)
        first = body.get("first")
        return cls(FailureRecord(**body["failure"]), FailureRecord(**first) if first else None)


def cause_of(error: BaseException) -> Optional[str]:
    """The task whose loss `error` follows from ('' when it does not say which), or None when the
    error is the task's own. Follows explicit `raise ... from` links."""
    seen = set()
    while error is not None and id(error) not in seen:
        if _is_transport(error):  # the call's own sentence names the peer
            return ""
        if isinstance(error, PeerLost):
            return error.task or ""
        if isinstance(error, ClusterTimeoutError) and error.missing:  # it waited for tasks that never came
            return error.missing[0]
        seen.add(id(error))
        error = error.__cause__
    return None


def failed_key(job: str, index: int) -> str:
    return f"failed/{job}/{index}"


def failure_of(store, job: str, index: int) -> Optional[FailureRecord]:
    """The failure task (job, index) recorded in `store`, unless an older incarnation than its
    current one recorded it: a restarted task is not failed."""
    key = failed_key(job, index)
    if not store.check([key]):
        return None
    record = FailureRecord.from_json(store.get(key).decode())
    return record if record.restart >= _incarnation(store, job, index) else None


class RecordedTasks:
    """Which tasks have recorded a failure, read from the numbered records as they come.

    A task checking its peers needs the failure of the few that failed, not a read of every peer's key: at
    hundreds of tasks, that read made by every task at once (right when a failure is recorded) is N² store
    calls and delayed every notice by seconds. Every published record was numbered first, so the numbered
    records name every task that can have one: this reads each once (one call while the count stands), and
    a number counted but not yet written again on the next read. Thread-safe."""

    def __init__(self):
        self._read = 0  # numbers 1.._read were counted when last read
        self._unwritten: set = set()  # ... of which these were not written yet
        self._tasks: dict = {}  # (job, index) of the records read, in the order of their first record
        self._lock = threading.Lock()

    def of(self, store) -> list:
        """The (job, index) of every task that recorded a failure in `store` so far, the first to record first."""
        with self._lock:
            count = int(store.add(_COUNT, 0))
            if count < self._read:  # a store started afresh: its records are not the ones read
                self._read, self._unwritten, self._tasks = 0, set(), {}
            numbers = sorted(self._unwritten | set(range(self._read + 1, count + 1)))
            self._read = max(self._read, count)
            if numbers:
                self._take(store, numbers)
            return list(self._tasks)

    def _take(self, store, numbers) -> None:
        found = _numbered.read(store, "failures/", numbers)
        self._unwritten = set(numbers) - set(found)  # counted, not written yet: read again next time
        for number in sorted(found):
            record = json.loads(found[number])
            if record.get("job") is not None and record.get("index") is not None:
                self._tasks.setdefault((record["job"], record["index"]), None)


def _incarnation(store, job: Optional[str], index: Optional[int]) -> int:
    """A task's current restart count: what its Server wrote in the store (`Server.start`), else
    this task's own (all-reduce replicas have no Server, and the launcher restarts them together)."""
    key = f"incarnation/{job}/{index}"
    if job is not None and store.check([key]):
        return int(store.get(key).decode())
    return _restart_count()


class _Board:
    """The failures in one store: numbered, published, and the first own one found again."""

    def __init__(self, store):
        self.store = store

    def number(self, record: FailureRecord) -> FailureRecord:
        seq = int(self.store.add(_COUNT, 1))
        record = dataclasses.replace(record, seq=seq)
        self.store.set(f"failures/{seq}", record.to_json())
        return record

    def publish(self, record: FailureRecord) -> None:
        if record.job is not None and record.index is not None:
            self.store.set(failed_key(record.job, record.index), record.to_json())

    def first(self) -> Optional[FailureRecord]:
        """The own failure with the lowest number among the tasks' current incarnations."""
        own = []
        for n in range(1, int(self.store.add(_COUNT, 0)) + 1):
            r = FailureRecord.from_json(self.store.get(f"failures/{n}").decode())
            if r.is_own and r.restart >= _incarnation(self.store, r.job, r.index):
                own.append(r)
        return min(own, key=lambda r: r.seq) if own else None


_lock = threading.Lock()
_attached = None  # the started Server's store (Server attaches it)
_attached_task: Optional["_taskenv.TaskContext"] = None  # ... and the task it runs: what the records name
_recorded: Optional[FailureRecord] = None
_first: Optional[FailureRecord] = None
_report_error: Optional[str] = None  # why the launcher's report could not be written
_board_error: Optional[str] = None  # why the store could not number the record


def attach(store, task: Optional["_taskenv.TaskContext"] = None) -> None:
    """Record failures in this store, as `task` (a Server's, for as long as it runs). The excepthook that
    records them is one per process, as the Server is."""
    global _attached, _attached_task
    _attached, _attached_task = store, task


def detach(store) -> None:
    global _attached, _attached_task
    if _attached is store:
        _attached, _attached_task = None, None


def recorded() -> Optional[FailureRecord]:
    """This process's failure, once it was recorded."""
    return _recorded


def record(error: Optional[BaseException] = None, text: Optional[str] = None) -> FailureRecord:
    """Record this task's failure (an exception, or a reason as text); once per process: later
    calls return the first record. See the module docstring for where it goes and why then."""
    global _recorded, _first, _report_error, _board_error
    with _lock:
        if _recorded is not None:
            return _recorded
        rec = _make(error, text)
        found = _with_deadline(lambda: _number(rec))
        if isinstance(found, tuple):
            rec, _first = found
        elif found is not None:
            _board_error = f"could not record this failure in the cluster's store, so it is not numbered: {found}"
        path = _task_env().join.error_file
        if path:  # before the record is published: the launcher knows before any task reacts to it
            try:
                FailureReport(rec, _first).write(path)
            except OSError as e:
                _report_error = f"cannot write {ENV_ERROR_FILE}={path!r}: {e.strerror or e}"
        if isinstance(found, tuple):
            _with_deadline(lambda: _board().publish(rec))
        _recorded = rec
        return rec


def _number(rec: FailureRecord):
    board = _board()
    if board is None:
        return None
    rec = board.number(rec)
    return rec, board.first()


def _board() -> Optional[_Board]:
    if _attached is not None:
        return _Board(_attached)
    env = _task_env()
    address = env.join.store
    if address and etcd_url.is_etcd_url(address):
        from towerflow.cluster.store import stores
        from towerflow.cluster.spec import ClusterSpec

        if not env.identity.cluster:  # the run's prefix is named after the cluster: unknown here
            return None
        return _Board(stores.open_etcd(address, ClusterSpec(env.identity.cluster), BOARD_TIMEOUT, BOARD_TIMEOUT, "failure")[0])
    if address:
        host, port = split_address(address)
        from towerflow.cluster.store import c10d

        store = c10d.connect_store(host, port, BOARD_TIMEOUT, answer_within=BOARD_TIMEOUT)
        return _Board(c10d.prefix_store("towerflow", store))
    if "torch" not in sys.modules:  # no process group without torch
        return None
    from towerflow.cluster.store import c10d

    group_store = c10d.group_store()
    return _Board(c10d.prefix_store("towerflow", group_store)) if group_store is not None else None


def _with_deadline(fn: Callable[[], Any]) -> Any:
    """fn() in a helper thread, given up after BOARD_TIMEOUT s (a store whose host died may not answer)."""
    out = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:  # the store is gone: the record stays unnumbered, and the report says so
            out["value"] = e

    t = threading.Thread(target=run, name="towerflow-failure-record", daemon=True)
    t.start()
    t.join(BOARD_TIMEOUT)
    return out["value"] if "value" in out else TimeoutError(f"no answer within {BOARD_TIMEOUT:g} s")


def _task_env() -> "_taskenv.TaskContext":
    """The task the attached Server runs, else the one the environment names; a bad variable must not stop a
    failure from being recorded (it has its own error)."""
    if _attached_task is not None:
        return _attached_task
    try:
        return _taskenv.from_environment()
    except _taskenv.TaskEnvironmentError:
        return _taskenv.TaskContext()


def _restart_count() -> int:
    return _task_env().identity.restart_count


def _identity():
    """(name, job, index) of this process: its task, else its replica rank, else its pid."""
    task = _task_env()
    if task.has_task:
        return f"/job:{task.identity.job_name}/task:{task.identity.task_index}", task.identity.job_name, task.identity.task_index
    return (f"rank {task.identity.rank}" if task.identity.rank is not None else f"pid {os.getpid()}"), None, None


def _make(error: Optional[BaseException], text: Optional[str]) -> FailureRecord:
    name, job, index = _identity()
    if error is not None:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        cause = cause_of(error)
        text = _transport_reason(error) if _is_transport(error) else " ".join(str(error).split())
        line = f"{type(error).__name__}: {text}".rstrip(": ")
    else:
        tb = text or ""
        lines = [x for x in tb.splitlines() if x.strip()]
        line, cause = (lines[-1].strip() if lines else "failed"), None
    return FailureRecord(task=name, error=line[:2000], pid=os.getpid(), host=socket.gethostname(), time=time.time(),
                         job=job, index=index, restart=_restart_count(), cause=cause,
                         traceback=tb[-20000:] if cause is None else "")


_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ECONNREFUSED", "ECONNRESET",
         "EPIPE", "EOF", "Unknown destination worker")


def _is_transport(error: BaseException) -> bool:
    """Whether a call, a same-host link or a collective failed because a peer went away (not the task's own
    error)."""
    return isinstance(error, ConnectionLost) or _is_group_peer_lost(error)


def _is_group_peer_lost(error: BaseException) -> bool:
    """Whether a collective of the replicas' process group failed because a member is gone (gloo's
    'Connection reset by peer' / 'closed by peer' / broken pipe), rather than because of this replica."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not isinstance(error, RuntimeError):
        return False
    text = str(error)
    gone = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ECONNRESET", "EPIPE")
    return ("gloo" in text or isinstance(error, dist.DistError)) and any(g in text for g in gone)


def _transport_reason(error: BaseException) -> str:
    """A short reason for an error the transport raised because a peer went away (gloo's own text
    runs to source paths and advice meant for a single process)."""
    text = str(error)
    if not _is_group_peer_lost(error):
        return " ".join(text.split())  # the messaging layer's (or a same-host link's) own sentence names the peer
    what = next((g for g in _GONE if g in text), "connection lost")
    return f"lost a peer of its process group (gloo: {what})"


def describe(rec: FailureRecord, first: Optional[FailureRecord]) -> str:
    """What the task itself prints: one line, and the traceback of an own failure when no launcher
    will print it (under `towerflow launch` its verdict does, launch/verdict.py)."""
    note = "".join(f"towerflow: {problem}\n" for problem in (_board_error, _report_error) if problem)
    return note + _describe(rec, first)


def _describe(rec: FailureRecord, first: Optional[FailureRecord]) -> str:
    if not rec.is_own:
        why = rec.summary.split(": ", 1)[1]
        after = f" ({first.task} failed first: {first.error})" if first and first.task not in why else ""
        return f"towerflow: {why if why.startswith(rec.task + ' ') else rec.task + ' ' + rec.summary}{after}"
    if _task_env().join.error_file and _report_error is None:
        if first and first.task != rec.task:
            return f"towerflow: {rec.task} failed too, after {first.task}: {rec.error}"
        return f"towerflow: {rec.task} failed: {rec.error}; the launcher prints its traceback when the run ends"
    return f"towerflow: {rec.task} failed:\n{rec.traceback.rstrip()}"


def report(error: BaseException) -> None:
    """Record `error` as this task's failure and print what the task says of it (`describe`)."""
    rec = record(error)
    sys.stderr.write(describe(rec, _first) + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
