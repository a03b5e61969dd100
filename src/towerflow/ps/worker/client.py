"""A worker's side of one model's parameter servers: joining them, the training step, and what it reads back.

`PSClient` puts together the jobs of a worker's link to the ps tasks, each in its own module: `calls.py`
(a channel per ps task; a gone ps raises `PSTaskLost`), `stepping.py` (push, pull, install, over a same-host
link or ZeroMQ), `row_reads.py`, `inspection.py` (state read back), `counters.py` and `model_on_ps.py`.
This module keeps joining (the chief creates and opens the shards; the others wait, or rejoin) and the
end of training. What to do when a ps is lost is `recovery.py`'s job.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from towerflow.ps.layout import Layout
from towerflow.ps.messages import Endpoints, PolicySpec, PushPull, Rejoined
from towerflow.ps.tables import TableSpec
from towerflow.ps.worker import inspection
from towerflow.ps.worker.calls import PSCalls, ps_task_lost  # noqa: F401 - ps_task_lost: the error a loss raises
from towerflow.ps.worker.channel import Channel
from towerflow.ps.worker.counters import StepCounters
from towerflow.ps.worker.model_on_ps import ModelOnPS
from towerflow.ps.worker.row_reads import RowReader
from towerflow.ps.worker.stepping import Stepper


class PSClient:
    """This worker's link to the ps tasks of one model. `on_global_step` hears the ps's global step of every set
    of values installed (the strategy's `GlobalStep.restore`): the client writes no state of the strategy's."""

    def __init__(self, server, model_name: str, worker: int, is_chief: bool, device: torch.device,
                 policy: PolicySpec, prefetch: bool, on_global_step: Optional[Callable[[int], None]] = None,
                 ps_replicas: int = 1, replica_lag: int = 0):
        self.server, self.is_chief = server, is_chief
        self.calls = PSCalls(server, model_name)
        self.counters = StepCounters()
        self.stepper = Stepper(self.calls, self.counters, worker, device, policy, prefetch)
        self.rows = RowReader(self.calls, self.counters, worker, device)
        self.model: Optional[ModelOnPS] = None
        self._replication = (ps_replicas, replica_lag)
        self._on_global_step = on_global_step or (lambda step: None)
        self._global_step = 0
        self.finished = False  # this worker said it is done (or was restarted after it had)
        self.opened = False  # chief: the ps tasks let the other workers start once it has initialized them

    # ---- what others read
    model_name = property(lambda self: self.calls.model_name)
    worker = property(lambda self: self.stepper.worker)
    policy = property(lambda self: self.stepper.policy)
    channels = property(lambda self: self.calls.channels)
    layout = property(lambda self: self.model.layout if self.model else None)
    tables = property(lambda self: self.model.tables if self.model else {})
    pushes = property(lambda self: self.stepper.pushes)  # this worker's clock: pushes sent
    global_step = property(lambda self: self._global_step)  # the ps's, as of the last values installed
    ps_replicas = property(lambda self: self._replication[0])
    replica_lag = property(lambda self: self._replication[1])

    # ---- joining
    def attach(self, layout: Layout, params: Dict[str, torch.nn.Parameter], optimizer_cls, settings: dict,
               tables: Sequence[TableSpec] = (), table_values: Optional[Dict[str, torch.Tensor]] = None,
               row_optimizer=None, replan: Optional[Callable[[int], Layout]] = None) -> None:
        """The model's parameters and the optimizer the ps tasks run over them, and its embedding tables
        (shard t on ps task t) with their row optimizer: one channel per ps task that holds anything."""
        self.model = ModelOnPS(layout, params, (optimizer_cls, settings), {s.name: s for s in tables},
                               dict(table_values or {}), row_optimizer, replan, *self._replication)
        self.rows.tables = self.model.tables
        self.stepper.links = not self.model.tables
        self.calls.channels[:] = [Channel(t, layout, params, self.stepper.device, self.server.call_name_of("ps", t))
                                  for t in range(layout.num_ps) if layout.on_task(t) or tables]

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
        self.counters.start()
        return rejoined

    def create(self, ch: Channel, state: Optional[dict] = None, finished: Sequence[int] = (), open_now: bool = False,
               restored_for: Sequence[str] = (), snapshot: Any = None):
        """Ask `ch`'s ps task to hold its shards, restoring `state` (a checkpoint) or `snapshot` (its mirror's): a future."""
        return self.call(ch, Endpoints.create, self.model.create_request(
            ch, self.server.cluster, self.policy, self.stepper.prefetch, state, finished, open_now, restored_for, snapshot))

    def rejoin(self, restarted: bool, wait_open: bool = True, after_restore_of: Optional[str] = None) -> List[Rejoined]:
        """Learn this worker's place at every ps task after a loss (`after_restore_of`: once the chief restored
        them after that ps incarnation came back); the clock goes on from their count."""
        rejoined = self.on_all(Endpoints.rejoin, self.worker, restarted, wait_open, after_restore_of)
        for ch, r in zip(self.channels, rejoined):  # a checkpoint's ps tasks may have counted one push apart
            ch.pushes = r.pushes
        self.stepper.pushes = max((r.pushes for r in rejoined), default=0)
        return rejoined

    def clock_at_ps(self) -> List[Rejoined]:
        """Each ps task's count of this worker's pushes, asked without rejoining (a checkpoint keeps each worker's,
        and the old workers' when restored onto another number of workers; a fresh worker does not know them)."""
        return self.on_all(Endpoints.rejoin, self.worker, False, False, None)

    def follow_restarts(self) -> None:
        """After a ps task was restarted: call each ps task's current incarnation, forget values fetched ahead."""
        self.calls.follow_restarts()
        self.stepper.pending = None

    def keep_clock(self, pushes: int) -> None:  # after pushes were sent again: at least where it stood
        self.stepper.pushes = max(self.stepper.pushes, pushes)

    def finished_key(self, worker: int) -> str:
        """Where a worker's having finished is published (a ps restored later learns it there)."""
        return f"ps/{self.model_name}/finished/{worker}"

    def announce_finished(self) -> None:  # a ps restored later learns it from there
        self.server.publish(self.finished_key(self.worker), "1")

    def mark_opened(self) -> None:  # the shards were created open (a restore): the other workers may start
        self.opened = True

    def open(self) -> None:
        """Chief, first step (or finish): the shards are initialized or restored; let the other workers start."""
        if self.opened or not self.is_chief:
            return
        self.on_all(Endpoints.open_model)
        self.opened = True

    # ---- calls (what recovery.py needs of them)
    call = property(lambda self: self.calls.call)
    wait = property(lambda self: self.calls.wait)
    on_all = property(lambda self: self.calls.on_all)

    def resend(self, ch: Channel, slot: int, request: PushPull):
        """A step's push sent again to a ps task restored without it (`Recovery`)."""
        return self.stepper.send(ch, slot, request)

    # ---- the step
    pull = property(lambda self: self.stepper.pull)

    def install(self, futures: List[Any]) -> None:
        """Wait for pulls (or push-pulls) and copy their values into the model."""
        self._installed(self.stepper.install(futures))

    def push_pull(self, lr: Optional[float], row_grads: Optional[dict] = None, kind: str = "grad") -> None:
        """One training step (`stepping.py`): this worker's dense gradients (or deltas, `kind="delta"`) and its part
        of the tables' row gradients (`row_grads`: {table: (unique ids, grads)}) to every ps task."""
        rows = self.rows.pushes_by_task(row_grads)
        self.open()
        self._installed(self.stepper.push_pull(lr, rows, kind))

    def _installed(self, step: Optional[int]) -> None:
        if step is not None:
            self._global_step = step
            self._on_global_step(step)

    read_rows = property(lambda self: self.rows.read)

    # ---- the end
    def begin_finish(self) -> bool:
        """Mark this worker finished; whether the ps tasks still have to be told (not yet told, and joined)."""
        first, self.finished = not self.finished and bool(self.channels), True
        return first

    def finish(self) -> None:
        """Tell every ps task this worker is done, once its pushes have arrived; install what was fetched ahead."""
        self.open()
        # Finish first: a prefetched pull may wait on peers (ssp) that in turn wait on this worker.
        done = [(ch, self.call(ch, Endpoints.finish, self.worker, ch.pushes)) for ch in self.channels]
        self._installed(self.stepper.install_pending())
        for ch, f in done:
            self.wait(ch, f)

    def wait_finished(self) -> int:
        """Wait until every worker has finished; the final global step."""
        steps = self.on_all(Endpoints.wait_finished)
        return steps[0] if steps else self.global_step

    # ---- state read back
    def state(self) -> Dict[int, dict]:
        return inspection.state(self.calls)

    def load_state(self, parts: Dict[Any, dict]) -> None:
        """Put checkpoints back on the ps tasks (`inspection.load_state`) and pull them into the model."""
        inspection.load_state(self.calls, self.model, parts)
        self.install(self.pull())

    def metrics(self) -> dict:
        """This worker's view: steps/s, bytes pushed and pulled per ps task, what became of its pushes, and how it
        reaches each ps task ("shm": the same-host link, else "zmq")."""
        return self.counters.metrics(self.worker, self.pushes, self.global_step,
                                     {f"/job:ps/task:{ch.task}": "shm" if ch.link is not None else "zmq"
                                      for ch in self.channels})
