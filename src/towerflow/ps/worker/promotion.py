"""Which ps task serves a lost task's part (`--ps-replicas 2`): the worker's choice between waiting for a restart
and promoting a backup (docs/fault-tolerance.md, "A primary not back in time").

A lost task's part goes to its backup, the next ps task round the ring, once the task is not back within
`TOWERFLOW_PS_PROMOTE_AFTER` seconds, or at once when the launcher will not restart it and its heartbeats have
stopped. A promoted backup feeds a mirror of the part to the next task in turn, so when it is lost too, that task
takes the part over; so does the next one when the task asked to serve the part is lost during that very call,
unless another worker had the part served elsewhere meanwhile. Every worker asks the same tasks in the same order,
and a task that serves a part already answers yes to all of them (`ServedModels.promote`, ps/server/endpoints.py).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Set, Tuple

from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.calls.names import task_of
from towerflow.errors import ClusterError, ClusterTimeoutError, ParameterServerError
from towerflow.ps.messages import Endpoints
from towerflow.ps.replication_messages import backup_of, part_key, ps_hosts
from towerflow.errors import PSTaskLost


class Promotion:
    """A worker's promotions of backups in place of lost ps tasks, and why each part is served where it is."""

    def __init__(self, client):
        self.client = client
        self.server = client.server
        self._lost_too: Dict[int, List[str]] = {}  # by part: who served it or was asked to, lost too (not asked again)
        self._until: Optional[float] = None  # this recovery's promotion wait ends then, for every loss it finds
        self._beats: Dict[int, int] = {}  # each ps task's beats when the recovery began, until its first wait

    def begin(self) -> None:
        """A recovery begins: every loss it finds waits for its restart until the same moment, however late it is
        found (the ps tasks of a host go down together; their waits must not add up), and a task counts as living
        on by its beats since now. Where the beats cannot be read, each loss waits the whole time, as before."""
        self._until, self._beats, self._lost_too = None, {}, {}
        if self.client.ps_replicas > 1:
            try:
                self._beats = {ch.task: self.server.membership.beat_count("ps", ch.task) for ch in self.client.channels}
            except Exception:  # the store did not answer: the waits go one after the other
                return
            self._until = time.monotonic() + self.server.context.ps.promote_after

    def wait_or_promote(self, gone: PSTaskLost) -> Optional[str]:
        """The lost task's call name once it is back (a restarted incarnation's, or its own when it lives on), or
        None when its backup serves its part instead: with replicated shards, one not back within
        `TOWERFLOW_PS_PROMOTE_AFTER` seconds is replaced by its backup (promoted), until it is; one the launcher
        will not restart (no restarts left) as soon as its heartbeats show it gone."""
        server, cause = self.server, str(gone.reason)
        if self.client.ps_replicas > 1:
            wait = server.context.ps.promote_after
            ch = next(c for c in self.client.channels if c.task == gone.part)
            if ch.via is not None and gone.name == ch.via:
                return self._promote_onward(ch, gone)
            if self.served_by_backup(gone):
                return None  # another worker's wait ended first
            if not server.membership.will_be_restarted("ps", gone.part):
                if not server.membership.beats_on("ps", gone.part, wait) and self._promote(gone):
                    return None
            else:
                beats_before = self._beats.pop(gone.part, None)  # a task's first wait in the recovery only: one lost
                if beats_before is not None:  # again (a restarted incarnation) waits anew, its beats counted anew
                    wait = max(0.0, self._until - time.monotonic())
                try:
                    return server.wait_for_restart("ps", gone.part, gone.name, cause, wait, alive_ok=True,
                                                   beats_before=beats_before)
                except ClusterTimeoutError:
                    if self._promote(gone):
                        return None
            lost_too = self._lost_too.get(gone.part)
            if lost_too and not server.membership.will_be_restarted("ps", gone.part):
                were = "was" if len(lost_too) == 1 else "were"
                raise ParameterServerError(
                    f"/job:ps/task:{gone.part}'s part is lost: that task will not be restarted (no restarts left) and "
                    f"{', '.join(lost_too)}, asked to serve its part in its place, {were} lost too, with no other ps "
                    "task holding a mirror of it. Restart the job from the newest checkpoint")
        return server.wait_for_restart("ps", gone.part, gone.name, cause, alive_ok=True)

    def _promote_onward(self, ch, gone: PSTaskLost) -> Optional[str]:
        """The backup that served a lost task's part (promoted) is lost too: the next ps task round the ring, which
        it fed a mirror of the part, serves it now (None); without one, the part's own task is waited for (its call
        name once back), as without replicas, or, when it will not be restarted, the job ends saying so. A backup
        that beats on only lost a connection: its own name comes back, and the caller connects to it again."""
        via, server = ch.via, self.server
        via_task = task_of(via)[1]
        if self._lives_on(via_task, via):
            return via
        lost_too = self._lost_too.setdefault(gone.part, [])
        if via not in lost_too:
            lost_too.append(via)
        onward = backup_of(via_task, ps_hosts(server.cluster))
        if onward != gone.part and self._promote(gone, lost=via, at=onward):
            return None
        if not server.membership.will_be_restarted("ps", gone.part):
            raise ParameterServerError(
                f"/job:ps/task:{gone.part}'s part is lost: that task will not be restarted (no restarts left) and "
                f"{via}, the backup that served its part, is gone too ({gone.reason}), with no other ps task holding a "
                "mirror of it. Restart the job from the newest checkpoint; with 3 or more ps tasks a promoted part "
                "gets a backup of its own")
        return server.wait_for_restart("ps", gone.part, ch.to, str(gone.reason), alive_ok=True)

    def why(self, task: int) -> str:
        """Why the lost task's part is served where it is now, for the worker's line."""
        lost_too = self._lost_too.get(task)
        if lost_too:
            backups = "the backup" if len(lost_too) == 1 else "the backups"
            return f"and then {', '.join(lost_too)}, {backups} that served its part, were lost"
        wait = self.server.context.ps.promote_after
        if not self.server.membership.will_be_restarted("ps", task):
            return f"will not be restarted (no restarts left) and was silent for {wait:g} s"
        return f"was not back within {wait:g} s"

    def served_by_backup(self, gone: PSTaskLost) -> bool:
        """Whether the lost task's backup serves its part already (it stands in for the task: membership.stand_in);
        then this worker calls the part there from now on, without waiting for a restart that may never come."""
        return ("ps", gone.part) in self.server.membership.stood_in() and self._promote(gone)

    def _promote(self, gone: PSTaskLost, lost: Optional[str] = None, at: Optional[int] = None) -> bool:
        """Ask the ps task `at` to serve the lost task's part in place of `lost` (`endpoints.promote`) and call it there
        from now on; False when no task can (a mirror that does not stand for `lost`, or none left). By default the
        task that stands in for the lost one already, else its backup, in place of the lost incarnation itself. One
        lost during the call is passed for the next (`_next_after`): otherwise this worker would wait for the lost
        task while its part goes on elsewhere. One whose heartbeats go on only lost a connection: no other is
        promoted beside it, and False."""
        server, lost_too, asked = self.server, self._lost_too.setdefault(gone.part, []), set()
        if at is None:
            by = server.membership.stood_in_by("ps", gone.part)
            at = task_of(by)[1] if by is not None else backup_of(gone.part, ps_hosts(server.cluster))
        while at is not None and at not in asked:  # each task once: the ring ends
            asked.add(at)
            backup = server.call_name_of("ps", at)
            if backup not in lost_too:
                try:
                    return self._serve_at(backup, at, gone, gone.name if lost is None else lost)
                except ClusterError:  # the backup went silent too, or is gone (ConnectionLost)
                    if self._lives_on(at, backup):
                        return False
                    lost_too.append(backup)
            at, lost = self._next_after(gone, at, backup, asked)
        return False

    def _next_after(self, gone: PSTaskLost, at: int, lost: str, asked: Set[int]) -> Tuple[Optional[int], Optional[str]]:
        """Who to ask for the lost task's part once `lost` (ps task `at`) is lost too, and in place of whom: the task
        that stands in for the lost one now, unless `asked` already (another worker had it serve the part meanwhile),
        else the next round the ring in place of `lost`, which fed it a mirror of the part once promoted; (None,
        None) past the ring's end."""
        by = self.server.membership.stood_in_by("ps", gone.part)
        if by is not None and task_of(by)[1] not in asked:
            return task_of(by)[1], None
        onward = backup_of(at, ps_hosts(self.server.cluster))
        return (onward, lost) if onward != gone.part else (None, None)

    def _serve_at(self, backup: str, at: int, gone: PSTaskLost, lost: str) -> bool:
        """`_promote`'s call to the incarnation `backup` of ps task `at`; raises ClusterError when that is lost."""
        client = self.client
        future = _calls.call_async(backup, Endpoints.promote, args=(client.model_name, gone.part, lost))
        self.server.wait_watching(future, task=("ps", at))
        if not future.wait():
            return False
        for ch in client.channels:
            if ch.task == gone.part:
                ch.serve_from(backup, part_key(client.model_name, gone.part))
        return True

    def _lives_on(self, task: int, name: str) -> bool:
        """Whether ps task `task`'s incarnation `name` beats on: only a connection to it was lost."""
        server = self.server
        return server.call_name_of("ps", task) == name and server.membership.beats_on(
            "ps", task, server.context.ps.promote_after)
