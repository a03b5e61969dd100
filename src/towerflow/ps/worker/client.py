"""A worker's link to every ps task of one model: the calls, their waits, and what they bring back.

`PSClient` holds one `Channel` per ps task that has shards of the model, and turns the
strategy's needs (set the shards up, one training step, finish) into calls of the ps's
endpoints, named by `messages.Endpoints`, all ps tasks at once. It keeps this worker's clock
(pushes sent), the global step it last read, and the counters `metrics()` reports. A call to a
ps task that is gone raises `PSTaskLost`; what to do then is `recovery.py`'s job, not this module's.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from towerflow.cluster.membership import membership as _membership
from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.calls.names import lost_task
from towerflow.errors import ConnectionLost, ParameterServerError, PSTaskLost
from towerflow.ps.layout import Layout
from towerflow.ps.worker import linked
from towerflow.ps.worker import reshard as _reshard
from towerflow.ps.worker import rows as _rows
from towerflow.ps.worker.channel import Channel
from towerflow.ps.messages import (CreateShards, Endpoint, Endpoints, PartMoved, PolicySpec, Pulled, PushPull,
                                   PushPulled, Rejoined, RowRead)
from towerflow.ps.replication_messages import backup_for, ps_hosts
from towerflow.ps.tables import TableSpec


def ps_task_lost(part: int, name: str, reason: str) -> PSTaskLost:
    """The error of a call to a ps task that is gone (`Recovery.guarded` catches it and recovers): the part of ps
    task `part`, served by the incarnation called `name` (the part's own, or its promoted backup)."""
    task, incarnation = lost_task(name)
    return PSTaskLost(part, name, reason, task, incarnation)


@contextlib.contextmanager
def _lost_as_pslost(ch: Channel) -> Iterator[None]:
    """A call, send or wait that failed because the channel's ps task is gone raises PSTaskLost (the rest as is)."""
    try:
        yield
    except PartMoved as e:
        raise ps_task_lost(ch.task, ch.to, str(e)) from e
    except ConnectionLost as e:  # the task lost: the part's own, or its promoted backup
        raise ps_task_lost(ch.task, ch.via or ch.to, str(e)) from e


class _FlatStep:
    """A dense step sent as plain values (`PushPull.flat`) on a direct channel: its reply read as a `PushPulled`."""

    def __init__(self, call):
        self.call = call

    def result(self, idle: Optional[Callable[[], None]] = None) -> PushPulled:
        return PushPulled.from_flat(self.call.result(idle))


class PSClient:
    """This worker's calls to the ps tasks of one model, its clock, and its counters."""

    def __init__(self, server, model_name: str, worker: int, is_chief: bool, device: torch.device,
                 policy: PolicySpec, prefetch: bool, steps):
        self.server = server
        self.model_name = model_name
        self.worker = worker
        self.is_chief = is_chief
        self.device = device
        self.policy = policy
        self.prefetch = prefetch
        self.ps_replicas = 1  # copies of each ps task's part (2: a mirror on the next ps task, docs/fault-tolerance.md)
        self.replica_lag = 0  # with 2: how many ops a reply may run ahead of the backup (0: none)
        self.layout: Optional[Layout] = None
        self.channels: List[Channel] = []
        self.pushes = 0  # this worker's clock: pushes sent (and, after a loss, kept by the ps)
        self.steps = steps  # the strategy's GlobalStep: the ps's global step as of the last values installed
        self.finished = False
        self.opened = False  # chief: the ps tasks let the other workers start once it has initialized them
        self._pending: Optional[List[Any]] = None  # prefetch: the push-pulls of the last step, not installed yet
        self._optimizer: Optional[tuple] = None  # (class, settings): what a restarted ps is rebuilt with
        self._params: Dict[str, torch.nn.Parameter] = {}
        self.tables: Dict[str, TableSpec] = {}
        self._table_values: Dict[str, torch.Tensor] = {}  # tables the chief built with values: sent once, at create
        self._row_optimizer = None
        self._last_read: tuple = ({}, {})  # (ids by table, their routing) of the last read_rows
        self.reads = 0  # read_rows calls answered (RowRead.number)
        self.replan: Optional[Callable[[int], Layout]] = None  # the layout this model has on n ps tasks (resharding)
        self._bytes_pushed: Dict[int, int] = collections.Counter()
        self._bytes_pulled: Dict[int, int] = collections.Counter()
        self._staleness: Dict[int, int] = collections.Counter()
        self._outcomes: Dict[str, int] = collections.Counter()
        self._started: Optional[float] = None
        self._pull_wait_s = 0.0

    # ---- setting up
    def attach(self, layout: Layout, params: Dict[str, torch.nn.Parameter], optimizer_cls, settings: dict,
               tables: Sequence[TableSpec] = (), table_values: Optional[Dict[str, torch.Tensor]] = None,
               row_optimizer=None) -> None:
        """The model's parameters and the optimizer the ps tasks run over them, and its embedding tables
        (shard t on ps task t) with their row optimizer: one channel per ps task that holds anything."""
        self.layout, self._params, self._optimizer = layout, params, (optimizer_cls, settings)
        self.tables = {spec.name: spec for spec in tables}
        self._table_values = dict(table_values or {})
        self._row_optimizer = row_optimizer
        self.channels = [Channel(t, layout, params, self.device, self.server.call_name_of("ps", t))
                         for t in range(layout.num_ps) if layout.on_task(t) or self.tables]

    def connect(self) -> Optional[List[Rejoined]]:
        """The chief creates the shards (a restarted chief finds them there and keeps them); the others
        wait until the chief has initialized them, or, restarted, rejoin. Then pull the values.
        Returns the ps tasks' `Rejoined` when this worker is a restarted one."""
        rejoined = None
        if self.is_chief:
            for ch, f in [(ch, self.create(ch)) for ch in self.channels]:
                self.wait(ch, f)
        if self.server.incarnation > 0:  # restarted: go on from the ps's step, with the clock its pushes set
            rejoined = self.rejoin(restarted=True, wait_open=not self.is_chief)
            self.finished = any(r.finished for r in rejoined)  # killed after finish(): it trains no more
            if self.finished:  # (again: it may have died before it said so) a ps restored later learns it
                self.announce_finished()
        elif not self.is_chief:
            self.on_all(Endpoints.wait_ready)
        self.install(self.pull())
        self._started = time.perf_counter()
        return rejoined

    def create(self, ch: Channel, state: Optional[dict] = None, finished: Sequence[int] = (), open_now: bool = False,
               restored_for: Sequence[str] = (), snapshot: Any = None):
        """Ask `ch`'s ps task to hold its shards, restoring `state` (a checkpoint) or `snapshot` (its mirror's): a future."""
        cls, settings = self._optimizer
        shard_values = {}
        for name, value in self._table_values.items():
            spec = self.tables[name]
            rows, _ = spec.route(torch.arange(spec.rows))
            shard_values[name] = value.detach().to("cpu")[rows == ch.task]
        return self.call(ch, Endpoints.create, CreateShards(
            ch.shards, self.layout.pack(ch.task, self._params), cls, settings, self.policy, state, tuple(finished),
            open_now, ch.task, tuple(self.tables.values()), shard_values, self._row_optimizer, tuple(restored_for),
            backup_for(ch.task, ps_hosts(self.server.cluster), self.ps_replicas), snapshot, self.replica_lag, self.prefetch))

    def rejoin(self, restarted: bool, wait_open: bool = True, after_restore_of: Optional[str] = None) -> List[Rejoined]:
        """Learn this worker's place at every ps task after a loss (`after_restore_of`: once the chief restored
        them after that ps incarnation came back); the clock goes on from their count."""
        rejoined = self.on_all(Endpoints.rejoin, self.worker, restarted, wait_open, after_restore_of)
        for ch, r in zip(self.channels, rejoined):  # a checkpoint's ps tasks may have counted one push apart
            ch.pushes = r.pushes
        self.pushes = max((r.pushes for r in rejoined), default=0)
        return rejoined

    def clock_at_ps(self) -> List[Rejoined]:
        """Each ps task's count of this worker's pushes, asked without rejoining (a checkpoint keeps each worker's,
        and the old workers' when restored onto another number of workers; a fresh worker does not know them)."""
        return self.on_all(Endpoints.rejoin, self.worker, False, False, None)

    def follow_restarts(self) -> None:
        """After a ps task was restarted: call each ps task's current incarnation, forget values fetched ahead."""
        for ch in self.channels:
            now = self.server.call_name_of("ps", ch.task)
            if now != ch.to or ch.via is None:  # a part its backup serves stays there until the task is back
                ch.to = now
                ch.serve_from(None, None)  # the next step offers the new incarnation a link
        self._pending = None

    def finished_key(self, worker: int) -> str:
        """Where a worker's having finished is published (a ps restored later learns it there)."""
        return f"ps/{self.model_name}/finished/{worker}"

    def announce_finished(self) -> None:
        self.server.publish(self.finished_key(self.worker), "1")

    # ---- calls
    def call(self, ch: Channel, fn: Endpoint, *args: Any):
        """fn(model, *args) on the channel's ps task, a future; a gone ps raises PSTaskLost."""
        with _lost_as_pslost(ch):
            return _calls.call_async(ch.via or ch.to, fn, args=(ch.key or self.model_name, *args))

    def _try_link(self, ch: Channel) -> None:
        """Once per ps incarnation: offer a ps task of this host a shared-memory link for the steps (`linked.py`)."""
        if ch.link_tried_for == ch.to or self.tables or ch.via is not None:
            return
        ch.link_tried_for = ch.to
        if not linked.wanted(self.server.cluster, (self.server.job_name, self.server.task_index), ch.task,
                             self.server.context.ps_link):
            return
        link = linked.offer_for(ch, self.server.name)
        if link is None:
            return
        try:
            accepted = self.wait(ch, self.call(ch, Endpoints.attach_link, self.worker, link.offer))
            if accepted:
                link.connect()
                ch.use_link(link)
        finally:
            if ch.link is not link:
                link.close()

    def _push_pull_call(self, ch: Channel, slot: int, request: PushPull):
        """The step's call to one ps task: over its same-host link when it has one, else over this thread's
        direct channel to it (cluster/calls/direct.py); what `wait` reads a `PushPulled` from."""
        ch.sent.append((slot, request))  # sent again when the ps is lost and its mirror lacks it (recovery.py)
        with _lost_as_pslost(ch):
            if ch.link is not None and request.rows is None:
                return linked.push_pull(ch.link, slot, request)
            if ch.direct is None:
                ch.direct = _calls.direct_channel(ch.via or ch.to)
            if request.rows is None:
                return _FlatStep(ch.direct.call(Endpoints.push_pull_flat, ch.key or self.model_name, *request.flat()))
            return ch.direct.call(Endpoints.push_pull, ch.key or self.model_name, request)

    def wait(self, ch: Channel, future) -> Any:
        """The call's reply. A ps cut off by the network never fails the call, and a sync or ssp pull also
        waits on other workers: the wait watches their heartbeats, and the ps tasks' restarts, to say when
        to stop waiting."""
        watch = self._watch()
        with _lost_as_pslost(ch):
            if not isinstance(future, torch.futures.Future):  # a link's or direct channel's step: read in this thread
                return future.result(idle=watch)
            _membership.wait_for(future, watch)
            return future.wait()

    def _watch(self) -> Callable[[], None]:
        """A check for a wait on the ps: raises PeerLost for a task that failed or went silent, and PSTaskLost
        for a ps task restarted since this worker last called it. A sync round waits on ps task 0 for a worker
        that is itself waiting for the chief to restore ps task 1: the chief has to learn of that restart even
        when none of its own calls saw the loss."""
        peers = self.server.peer_watch(serving=("ps",))

        def check() -> None:
            peers()
            for ch in self.channels:
                now = self.server.call_name_of("ps", ch.task)
                if now != ch.to:
                    raise ps_task_lost(ch.task, ch.to, f"it was restarted (now {now})")
        return check

    def on_all(self, fn: Endpoint, *args: Any) -> List[Any]:
        """fn(model, *args) on every ps task at once; their replies in channel order."""
        calls = [(ch, self.call(ch, fn, *args)) for ch in self.channels]
        return [self.wait(ch, f) for ch, f in calls]

    def on_each(self, fn: Endpoint, args_of: Callable[[Channel], tuple]) -> List[Any]:
        """fn(model, *args_of(ch)) on every ps task at once; their replies in channel order."""
        calls = [(ch, self.call(ch, fn, *args_of(ch))) for ch in self.channels]
        return [self.wait(ch, f) for ch, f in calls]

    # ---- table rows
    def read_rows(self, ids_by_table: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The rows of every table's unique ids, one call per ps task (all in flight at once)."""
        routed = _rows.route(self.tables, ids_by_table)
        self._last_read = (ids_by_table, routed)  # the push of these rows' gradients routes them alike
        calls = [(ch, routed[ch.task], self.call(ch, Endpoints.read_rows, RowRead(
            self.worker, tuple(n for n, _, _ in routed[ch.task]), tuple(k for _, _, k in routed[ch.task]), self.reads + 1)))
            for ch in self.channels if routed.get(ch.task)]
        out = {name: torch.empty(ids.numel(), self.tables[name].dim, dtype=self.tables[name].dtype)
               for name, ids in ids_by_table.items()}
        for ch, parts, future in calls:
            rows = self.wait(ch, future)
            for (name, mask, keys), r in zip(parts, rows):
                out[name][mask] = r
                self._bytes_pulled[ch.task] += keys.numel() * keys.element_size() + r.numel() * r.element_size()
        self.reads += 1  # a read sent again (a lost ps) keeps its number
        if self.device.type != "cpu":
            out = {name: r.to(self.device, non_blocking=True) for name, r in out.items()}
        return out

    # ---- pulls and pushes
    def pull(self) -> List[Any]:
        """Futures of every ps task's values for this worker's next step (its clock at each ps task)."""
        return [self.call(ch, Endpoints.pull, self.worker, ch.pushes) for ch in self.channels]

    def install(self, futures: List[Any]) -> None:
        """Wait for pulls (or push-pulls) and copy their values into the model."""
        t0 = time.perf_counter()
        for ch, f in zip(self.channels, futures):
            reply = self.wait(ch, f)
            if isinstance(reply, PushPulled):
                self._count(reply)
                reply = reply.pulled
            pulled: Pulled = reply
            ch.install(pulled.ticket, pulled.values, self.device)
            self._bytes_pulled[ch.task] += ch.nbytes
        self._pull_wait_s += time.perf_counter() - t0
        self.steps.restore(self.channels[0].ticket.step if self.channels else 0)

    def _count(self, reply: PushPulled) -> None:
        self._outcomes[reply.outcome.kind] += 1
        if reply.outcome.kind != "dropped":
            self._staleness[reply.outcome.staleness] += 1

    def push_pull(self, lr: Optional[float], row_grads: Optional[dict] = None, kind: str = "grad") -> None:
        """One training step: one push-pull call per ps task, all in flight at once, carrying its dense
        gradients and its part of the tables' row gradients (`row_grads`: {table: (unique ids, grads)});
        with prefetch, install the previous step's values (these come back while the worker computes).
        `kind="delta"`: the `.grad` slots hold a local-steps worker's parameter deltas (`local_steps.py`)."""
        rows = _rows.pushes_by_task(self.tables, self._last_read, row_grads)
        self.open()
        k = self.pushes % 2  # push buffer set k was last used two steps ago, and that call has been waited for
        self.pushes += 1
        calls = []
        for ch in self.channels:
            self._try_link(ch)
            ch.pushes += 1
            clock = ch.pushes + (1 if self.prefetch else 0)  # the step the returned values will compute
            after = ch.ticket.step + 1 if self.policy.mode == "sync" else 0  # sync: come back after the aggregated update
            part = rows.get(ch.task)
            request = PushPull(self.worker, ch.ticket, ch.gather(k), lr, clock, after, part, kind)
            calls.append(self._push_pull_call(ch, k, request))
            self._bytes_pushed[ch.task] += ch.nbytes + (part.nbytes if part is not None else 0)
        if not self.prefetch:
            self.install(calls)
        elif self._pending is None:  # first step: nothing fetched ahead yet; compute once more on these values
            self._pending = calls
        else:
            previous, self._pending = self._pending, calls
            self.install(previous)

    def open(self) -> None:
        """Chief, first step (or finish): the shards are initialized or restored; let the other workers start."""
        if self.opened or not self.is_chief:
            return
        self.on_all(Endpoints.open_model)
        self.opened = True

    # ---- the end
    def finish(self) -> None:
        """Tell every ps task this worker is done, once its pushes have arrived; install what was fetched ahead."""
        self.open()
        # Finish first: a prefetched pull may wait on peers (ssp) that in turn wait on this worker.
        done = [(ch, self.call(ch, Endpoints.finish, self.worker, ch.pushes)) for ch in self.channels]
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.install(pending)  # its pushes count, and the model ends with the latest values
        for ch, f in done:
            self.wait(ch, f)

    @property
    def global_step(self) -> int:
        return self.steps.value

    def wait_finished(self) -> int:
        """Wait until every worker has finished; the final global step."""
        steps = self.on_all(Endpoints.wait_finished)
        return steps[0] if steps else self.global_step

    # ---- checkpoints and inspection
    def state(self) -> Dict[int, dict]:
        """Every ps task's checkpoint, by task."""
        return {ch.task: part for ch, part in zip(self.channels, self.on_all(Endpoints.state))}

    def load_state(self, parts: Dict[Any, dict]) -> None:
        """Put checkpoints (by task, int or str keys) back on the ps tasks and pull them into the model."""
        if self.replan is not None and _reshard.needs_reshard(parts, self.layout.num_ps, self.tables):
            old = self.replan(len(parts))  # written with another number of ps tasks (or table partition)
            parts = _reshard.reshard(parts, old, self.layout, self.tables, self._row_optimizer)
        missing = [ch.task for ch in self.channels if ch.task not in parts and str(ch.task) not in parts]
        if missing:
            raise ParameterServerError(f"the checkpoint has no state for ps tasks {missing}; it was saved with another layout")
        self.on_each(Endpoints.load_state, lambda ch: (parts.get(ch.task, parts.get(str(ch.task))),))
        self.install(self.pull())

    def values(self) -> Dict[str, torch.Tensor]:
        """The current values on the ps tasks, reassembled per variable."""
        by_shard: Dict[str, torch.Tensor] = {}
        for part in self.on_all(Endpoints.values):
            by_shard.update(part)
        return {v: self.layout.assemble(v, [by_shard[s.name] for s in self.layout.shards_of(v)])
                for v in self.layout.variables}

    def table_values(self) -> Dict[str, torch.Tensor]:
        """Every fixed table, put together from its shards on the ps tasks (for tests and small exports)."""
        return _rows.assemble(self.tables, dict(zip((ch.task for ch in self.channels), self.on_all(Endpoints.table_values))))

    def ps_metrics(self) -> Dict[str, dict]:
        """Each ps task's counters, by task name."""
        return {f"/job:ps/task:{ch.task}": r for ch, r in zip(self.channels, self.on_all(Endpoints.metrics))}

    def metrics(self) -> dict:
        """This worker's view: steps/s, bytes pushed and pulled per ps task, what became of its pushes, and how it
        reaches each ps task ("shm": the same-host link, else "zmq": calls over ZeroMQ)."""
        elapsed = time.perf_counter() - self._started if self._started else 0.0
        ps = lambda counts: {f"/job:ps/task:{t}": n for t, n in sorted(counts.items())}  # noqa: E731
        return {
            "worker": self.worker,
            "steps": self.pushes,
            "global_step": self.global_step,
            "steps_per_s": self.pushes / elapsed if elapsed > 0 else 0.0,
            "bytes_pushed": ps(self._bytes_pushed),
            "bytes_pulled": ps(self._bytes_pulled),
            "pushes_applied": self._outcomes["applied"],
            "pushes_held": self._outcomes["held"],
            "pushes_dropped": self._outcomes["dropped"],
            "staleness_histogram": dict(sorted(self._staleness.items())),
            "pull_wait_s": self._pull_wait_s,
            "links": {f"/job:ps/task:{ch.task}": "shm" if ch.link is not None else "zmq" for ch in self.channels},
        }
