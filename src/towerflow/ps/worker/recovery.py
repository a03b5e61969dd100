"""Losing a ps task mid-training, and going on: the worker's side of docs/fault-tolerance.md.

The launcher restarts a lost ps task empty. Every worker waits for it (`Server.wait_for_restart`);
the chief then puts it back while the others wait for that, and all go on. With replicated shards
(`--ps-replicas 2`) the chief restores only the lost task, from its mirror (`from_mirrors.py`), and
a training step in flight is finished exactly: each ps task that does not count this worker's push
gets it again, the others answer the pull the step would have made. Otherwise, or when a part's
every replica is lost, every ps task goes back to the newest checkpoint and the step in flight is
lost with the ps. Any other wire operation is run again once the ps is back (`Recovery.guarded`). A lost task
not back in time, or not to be restarted, has its part served by a backup instead (`promotion.py`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

from towerflow import _log
from towerflow.cluster.calls import endpoint as _calls
from towerflow.errors import ParameterServerError
from towerflow.ps.messages import Endpoints
from towerflow.ps.worker import from_mirrors
from towerflow.errors import PSTaskLost
from towerflow.ps.worker.client import PSClient, ps_task_lost
from towerflow.ps.worker.promotion import Promotion

LOOK_BACK_EVERY_S = 1.0  # how often a worker asks whether a ps task whose backup serves its part is back (two store reads)


class Recovery:
    """Runs a client's wire operations so that a lost ps task is waited for, restored, and gone on from."""

    def __init__(self, client: "PSClient"):
        self.client = client
        self.server = client.server
        self.restore_source: Optional[Callable[[], Any]] = None  # the chief's newest checkpoint, see restore_ps
        self.recoveries: List[dict] = []  # one entry per lost ps this worker went on after
        self.lost_with_chief: List[int] = []  # ps tasks a restarted chief found empty, until it restores them
        self._next_look = 0.0  # when to look again whether a ps task whose backup serves its part is back
        self._checkpoint_begun = False  # this recovery began to put every ps task back to the checkpoint
        self.promotion = Promotion(client)

    def _say(self, text: str) -> None:
        _log.get("ps", self.server.name).info(text)

    def guarded(self, op: Callable[[], Any], retry: bool = True) -> Any:
        """Run a wire operation; when a ps is lost, recover and run it again (`retry`), or return None (a
        training step: its gradient is lost with the ps, unless the ps came back from its mirror, and then
        `recover` has finished the step)."""
        self.finish_pending_restore()
        while True:
            try:
                result = op()
            except PSTaskLost as lost:
                self.recover(lost)
                if not retry:
                    return None
                continue
            try:
                self._follow_parts_back()
            except PSTaskLost as lost:  # after a whole operation: the restore finds it counted, nothing runs again
                self.recover(lost)
            return result

    def _follow_parts_back(self) -> None:
        """A part its backup serves (promoted) goes back to its ps task once the launcher restarted that: looked for
        every LOOK_BACK_EVERY_S, and taken as a loss of the task, which the chief restores from the part."""
        client = self.client
        promoted = [ch for ch in client.channels if ch.via is not None]
        if not promoted or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + LOOK_BACK_EVERY_S
        for ch in promoted:
            now = self.server.call_name_of("ps", ch.task)
            if now != ch.to:
                raise ps_task_lost(ch.task, ch.to, f"it was restarted (now {now})")

    def connect(self) -> Any:
        """`client.connect`, guarded. A restarted chief that finds some ps tasks empty beside others that kept their
        state (they were lost together with it: its host went down with them) puts them back as a chief that had
        seen the loss would, never afresh from its own initial values: from their mirrors (`--ps-replicas 2`), else
        every ps task from the newest checkpoint, once the session says where that is (`finish_pending_restore`)."""
        client = self.client
        if client.is_chief and self.server.incarnation > 0:
            holds = self._holds_once_back()
            if any(holds) and not all(holds):  # all: nothing lost; none: the whole job, the session's restore
                if not (client.ps_replicas > 1 and self.guarded(self._restore_lost_with_chief)):
                    self.lost_with_chief = [ch.task for ch, held in zip(client.channels, holds) if not held]
                    return None
        return self.guarded(client.connect)

    def _holds_once_back(self) -> List[bool]:
        """Which ps tasks hold their part, asked of each one's current incarnation: one that is gone (lost with this
        chief and not back yet) is waited for first, unless its backup serves its part already (then asked there),
        and nothing restored before all are asked."""
        client = self.client
        while True:
            try:
                return client.on_all(Endpoints.holds)
            except PSTaskLost as lost:
                if not self.promotion.served_by_backup(lost):
                    self.server.wait_for_restart("ps", lost.part, lost.name, str(lost.reason))
                client.follow_restarts()  # a restarted one is asked next; a part its backup serves, there

    def _restore_lost_with_chief(self) -> bool:
        """From their mirrors; False when some empty task's part has no mirror left (its backup was lost too)."""
        restored = from_mirrors.restore(self.client, self.server.publish)
        for task, backup in sorted((restored or {}).items()):
            self._say(f"restored /job:ps/task:{task}, lost together with this chief, from its mirror on {backup}")
        return restored is not None

    def finish_pending_restore(self) -> bool:
        """Chief: restore every ps task from the newest checkpoint after `connect` found some lost with it (the
        other workers wait for that), and join them; whether it did (a no-op otherwise). Without a checkpoint it
        raises, saying how to keep one."""
        client, lost = self.client, self.lost_with_chief
        if not lost:
            return False
        self.lost_with_chief = []
        seen = time.monotonic()
        path = self.restore_ps()
        client.rejoin(restarted=True, wait_open=False)
        client.install(client.pull())
        empty = ", ".join(f"/job:ps/task:{t}" for t in lost)
        self._say(f"{empty} came back empty together with this restarted chief, with no mirror to restore from: "
                  f"restored every ps task from {os.path.basename(path)}; going on at global step {client.global_step}; "
                  f"lost: the global steps since that checkpoint; {time.monotonic() - seen:.2f} s")
        self.recoveries.append({"ps_task": lost[0] if len(lost) == 1 else lost, "lost_with_chief": True,
                                "resumed_at_step": client.global_step, "from_mirrors": False, "checkpoint": path,
                                "seconds": round(time.monotonic() - seen, 2)})
        return True

    def recover(self, lost: PSTaskLost) -> None:
        """Wait for the launcher to restart the lost ps; the chief restores it (`restore_ps`), all pull
        the restored values and go on; the recovery is logged and kept in `recoveries`. Another ps task
        lost meanwhile (two at once, or one more during the restore) is waited for too, and the restore
        runs again with every lost task back."""
        client = self.client
        seen = time.monotonic()
        before = client.global_step
        sent, clock = {ch.task: ch.pushes for ch in client.channels}, client.pushes  # before a rejoin resets them
        lost_tasks = {lost.part: lost}
        self.promotion.begin()
        self._checkpoint_begun = False
        pushes_lost = 0  # with asynchronous replication: pushes the restored mirror lacked beyond those kept
        said = set()
        while True:
            alive, promoted = [], []
            for gone in lost_tasks.values():
                if self.server.max_restarts and gone.name not in said:  # else wait_for_restart raises at once, and
                    said.add(gone.name)  # that error says it all
                    self._say(f"lost /job:ps/task:{gone.part} at global step {before} ({gone.reason}); waiting for "
                              "its restart")
                back = self.promotion.wait_or_promote(gone)
                (alive if back == gone.name else promoted if back is None else []).append(gone)
            self._connect_again(alive, seen)
            client.follow_restarts()
            back_as = [self.server.call_name_of("ps", t) for t in sorted(lost_tasks)  # this recovery's new names
                       if t not in {g.part for g in alive + promoted}]
            try:
                if not back_as:  # connections were lost, or backups serve the lost parts: nothing to restore
                    client.rejoin(restarted=False, wait_open=False)
                    pushes_lost, from_mirror, source = self._send_again(sent, clock), False, None
                    break
                source = self.restore_ps() if client.is_chief else None
                client.rejoin(restarted=False, after_restore_of=back_as[-1])
                from_mirror = self.server.lookup(from_mirrors.outcome_key(client.model_name, back_as[-1])) == "mirror"
                if from_mirror:
                    pushes_lost = self._send_again(sent, clock)
                else:
                    client.install(client.pull())
                break
            except PSTaskLost as again:
                lost_tasks[again.part] = again
        took = time.monotonic() - seen
        tasks = sorted(lost_tasks)
        if not back_as:
            self.recoveries.append({"ps_task": tasks[0] if len(tasks) == 1 else tasks, "lost_at_step": before,
                                    "resumed_at_step": client.global_step, "steps_lost": 0, "seconds": round(took, 2),
                                    "from_mirrors": False, "reconnected": bool(alive), "pushes_lost": pushes_lost,
                                    "promoted": sorted(g.part for g in promoted)})
            how = [f"{', '.join(f'/job:ps/task:{g.part}' for g in alive)} had not stopped (its heartbeats went on): "
                   "connected again"] if alive else []
            how += [f"/job:ps/task:{g.part} {self.promotion.why(g.part)}: its part is served by its backup {ch.via} "
                    "(promoted)" for g in promoted for ch in client.channels if ch.task == g.part]
            self._say(f"{'; '.join(how)}; going on at global step {client.global_step}; lost: nothing (what it had "
                      f"not counted is sent again); {took:.2f} s from seeing the loss to training again")
            return
        record = {"ps_task": tasks[0] if len(tasks) == 1 else tasks, "lost_at_step": before,
                  "resumed_at_step": client.global_step, "steps_lost": max(0, before - client.global_step),
                  "seconds": round(took, 2), "from_mirrors": from_mirror}
        if from_mirror and client.replica_lag:
            record["pushes_lost"] = pushes_lost
        if isinstance(source, str):
            record["checkpoint"] = source
        self.recoveries.append(record)
        if from_mirror:
            what = "the chief restored it from its mirror"
            lost_what = (f"{pushes_lost} of this worker's acknowledged pushes the backup did not hold yet (--ps-replica-lag "
                         f"{client.replica_lag}); the step in flight is sent again" if pushes_lost
                         else "nothing (the step in flight is sent again)")
        else:
            what = (f"restored every ps task from {os.path.basename(source)}" if isinstance(source, str)
                    else "the chief restored the ps tasks")
            lost_what = f"{record['steps_lost']} global steps since that checkpoint and the gradient in flight"
        for task in tasks:
            back_at = next((ch.to for ch in client.channels if ch.task == task), "?")
            self._say(f"/job:ps/task:{task} is back ({back_at}); {what}; going on at global step {client.global_step}; "
                      f"lost: {lost_what}; {took:.2f} s from seeing the loss to training again")

    def _connect_again(self, alive: List[PSTaskLost], seen: float) -> None:
        """Lost ps tasks whose incarnation lives on (its heartbeats go on): the next calls open new connections, for
        as long as the heartbeat and join timeouts allow from when the loss was seen (then an error says so)."""
        limit = self.server.heartbeat_timeout + self.server.membership.join_timeout
        for gone in alive:
            if time.monotonic() - seen > limit:
                raise ParameterServerError(
                    f"{self.server.name} cannot reach /job:ps/task:{gone.part} ({gone.name}), which is still running "
                    f"(its heartbeats in the store go on): no call got through for {limit:g} s ({gone.reason}). Check "
                    "the network between the two hosts (a firewall, a partition), or whether that ps task is stuck")
            self._say(f"/job:ps/task:{gone.part} ({gone.name}) is still running (its heartbeats go on): connecting to "
                      "it again")
            _calls.reconnect(gone.name)

    def _send_again(self, sent: Dict[int, int], clock: int) -> int:
        """After a restore from mirrors, put this worker back where it was, as if nothing had happened. A ps task
        restored from its mirror may lack this worker's last push or two (the reply to a push waits only for the
        one before it to reach the backup: ps/server/replication/replicator.py), whichever call saw the loss; they are pushed
        again, oldest first, each round waiting for its replies (a sync push must see its step's update before
        the next), and the values of the last round are installed: for a ps task that lacked nothing, the pull
        the last step made (sync: after that step's update). A training step the loss interrupted is so
        finished; any other call runs again after this. With asynchronous replication (`replica_lag`) a task may
        lack more pushes than this worker keeps: those are lost, and their count returned."""
        client = self.client
        again, lost = {}, 0
        for ch in client.channels:
            missing = sent.get(ch.task, 0) - ch.pushes
            if missing > len(ch.sent) and client.replica_lag:
                lost += missing - len(ch.sent)
                missing = len(ch.sent)
            if missing > len(ch.sent):
                raise ParameterServerError(
                    f"/job:ps/task:{ch.task} came back from its mirror {missing} pushes of {self.server.name} behind, "
                    f"and this worker keeps its last {len(ch.sent)}: the ps tasks hold replies for workers that "
                    "prefetch only when the chief prefetches too; give every worker the same prefetch setting")
            again[ch.task] = list(ch.sent)[len(ch.sent) - missing:] if missing > 0 else []
        kept = {ch.task: list(ch.sent) for ch in client.channels}  # sending again must not change what is kept
        rounds = max((len(r) for r in again.values()), default=0)
        for r in range(max(rounds, 1)):
            todos = []
            for ch in client.channels:
                late = rounds - len(again[ch.task])  # a channel's pushes to send again end with the last round
                todos.append(again[ch.task][r - late] if again[ch.task] and r >= late else None)
            if client.policy.mode == "sync":
                self._wait_for_steps(todos)
            calls = []
            for ch, todo in zip(client.channels, todos):
                if todo is not None:
                    ch.pushes += 1
                    calls.append(client.resend(ch, *todo))
                elif r == max(rounds, 1) - 1:  # the last round: this task counts every push; the step's pull
                    last = ch.sent[-1][1] if ch.sent else None
                    calls.append(client.call(ch, Endpoints.pull, client.worker, last.clock if last else ch.pushes,
                                             last.after_step if last else 0))
                else:
                    calls.append(None)
            if r < max(rounds, 1) - 1:
                for ch, call in zip(client.channels, calls):
                    if call is not None:
                        client.wait(ch, call)
            else:
                client.install(calls)
        for ch in client.channels:
            ch.sent.clear()
            ch.sent.extend(kept[ch.task])
        client.keep_clock(clock)
        return lost

    def _wait_for_steps(self, todos: List[Optional[tuple]]) -> None:
        """Sync: before a push is sent again, wait until its ps task reaches the push's step. The other workers send
        their own pushes again meanwhile, in no set order: one that the mirror lacks for the step before completes
        that step's round, and a push sent ahead of it would be refused as from another run."""
        client = self.client
        waits = [(ch, client.call(ch, Endpoints.pull, client.worker, ch.pushes, todo[1].ticket.step))
                 for ch, todo in zip(client.channels, todos) if todo is not None]
        for ch, call in waits:
            client.wait(ch, call)

    def restore_ps(self) -> Optional[str]:
        """Chief: put the ps tasks back; the checkpoint's path, or None when the lost ones came back from their
        mirrors (`--ps-replicas 2`, `from_mirrors.py`: the others keep their state). Otherwise every ps task goes
        back to the newest checkpoint (a restarted one comes back empty; a part whose every replica was lost has
        nothing newer). The restore counts for every ps incarnation now current: a worker waiting to rejoin after
        any of them came back (`rejoin(after_restore_of=...)`) goes on, whichever losses the chief itself noticed."""
        client = self.client
        if client.ps_replicas > 1 and not self._checkpoint_begun:  # once begun, every part goes to the checkpoint:
            # a part sent from a mirror after another task's loss cut the restore short would be from another step
            restored = from_mirrors.restore(client, self.server.publish)
            if restored is not None:
                for task, backup in sorted(restored.items()):
                    self._say(f"restored /job:ps/task:{task} from its mirror on {backup}")
                return None
            self._say("a ps task lost every replica of its part (its backup was lost too, restarted since it was "
                      "last seeded, or cut off from it): restoring every ps task from the newest checkpoint")
        self._checkpoint_begun = True
        restored_for = [ch.to for ch in client.channels]
        found = self.restore_source() if self.restore_source is not None else None
        if found is None:
            raise ParameterServerError(
                "a ps task was restarted and came back empty, and there is no checkpoint to restore it from: train "
                "under towerflow.MonitoredTrainingSession(..., logdir=DIR) (the chief checkpoints the ps state there), "
                "or restart the whole job"
            )
        step, path, state = found
        parts = (state or {}).get("ps") or {}
        finished = [w for w in range(client.policy.num_workers) if self.server.lookup(client.finished_key(w)) is not None]
        for ch in client.channels:
            self.server.publish(from_mirrors.outcome_key(client.model_name, ch.to), "checkpoint")
        calls = []
        for ch in client.channels:
            part = parts.get(ch.task, parts.get(str(ch.task)))
            if part is None:
                raise ParameterServerError(f"checkpoint {path} has no state for /job:ps/task:{ch.task}; it was saved "
                                           "with another number of ps tasks or layout")
            calls.append((ch, client.create(ch, part, finished, open_now=True, restored_for=restored_for)))
        for ch, f in calls:
            client.wait(ch, f)
        client.mark_opened()
        return path

    def say_rejoined(self, restarted_at: Optional[str]) -> None:
        """Log a restarted worker's return: where it goes on, what was lost, how long it was down
        (`restarted_at`: the launcher's time of its death, from the task environment)."""
        client = self.client
        down = f"; down {time.time() - float(restarted_at):.2f} s from its death to rejoining" if restarted_at else ""
        lost = ("nothing: it had finished training before it was killed, so it trains no more" if client.finished
                else "the gradient it was computing and its place in its data")
        _log.get("ps", self.server.name).info(
            f"rejoined training (restart {self.server.incarnation}) at global step "
            f"{client.global_step}; the ps kept its {client.pushes} earlier pushes; lost: {lost}{down}"
        )
