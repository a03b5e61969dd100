"""The chief's restore of lost ps tasks from their mirrors (`--ps-replicas 2`), leaving the others as they are.

A restarted ps task comes back empty. With replicated shards its part lives on in the mirror its backup
holds (`ps/server/replication/mirror.py`), equal to the lost primary up to the last op it forwarded, which covers
every reply a worker got. So the chief asks each empty task's backup for its mirror and sends it to the
task; the tasks that kept their state are not touched (no step goes back). When an empty task's
backup holds no mirror fed by the lost incarnation (it was lost too, or restarted since), or that
incarnation said it went on without its backup (cut off from it), that part's every replica is gone,
and the caller falls back to the newest checkpoint for every task. A part a backup serves while promoted is
taken from there, however far round the ring it went (a backup promoted in place of a lost promoted backup).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple

from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.calls.names import call_name
from towerflow.errors import ConnectionLost
from towerflow.ps.messages import Endpoints
from towerflow.ps.replication_messages import MirrorState, backup_of, ps_hosts, unreplicated_key


def outcome_key(model: str, incarnation: str) -> str:
    """Where the chief says how it restored the ps tasks after `incarnation` came back: "mirror" or "checkpoint"
    (a worker reads it once its rejoin, which waits for that restore, returns)."""
    return f"ps/{model}/restored-after/{incarnation}"


def restore(client, publish: Callable[[str, str], None]) -> Optional[Dict[int, str]]:
    """Chief: put every empty ps task back from its mirror and let the workers go on; {task: the backup it was
    restored from}, empty when no task was empty, or None (nothing sent) when some empty task has no mirror."""
    holds = client.on_all(Endpoints.holds)
    empty = [ch for ch, held in zip(client.channels, holds) if not held]
    mirrors: Dict[int, MirrorState] = {}
    sources: Dict[int, str] = {}
    for ch in empty:
        found = _find_mirror(client, ch.task, {c.task for c in empty})
        if found is None:
            return None
        mirrors[ch.task], holder = found
        sources[ch.task] = f"/job:ps/task:{holder}"
    restored_for: List[str] = [ch.to for ch in client.channels]
    for name in restored_for:
        publish(outcome_key(client.model_name, name), "mirror")
    calls = [(ch, client.create(ch, open_now=True, restored_for=restored_for,
                                snapshot=mirrors[ch.task].snapshot if ch.task in mirrors else None))
             for ch in client.channels]
    for ch, f in calls:
        client.wait(ch, f)
    client.mark_opened()
    return sources


def _find_mirror(client, task: int, empty: Set[int]) -> Optional[Tuple[MirrorState, int]]:
    """What to restore `task`'s part from, and the ps task that holds it: the part itself where a backup serves it
    (promoted; further round the ring when the backup that served it first was lost too), else its backup's mirror
    when that stands for the lost incarnations; None when neither is left (every replica lost)."""
    server = client.server
    hosts = ps_hosts(server.cluster)
    current = server.membership.incarnation_of("ps", task)
    lost = [call_name("ps", task, k) for k in range(max(current - 1, 0), -1, -1)]
    holder = backup_of(task, hosts)
    while holder != task:
        if holder not in empty:
            state = _mirror_state(server, client.model_name, task, holder)
            if state is not None and state.served and state.snapshot is not None:
                return state, holder
            if holder == backup_of(task, hosts) and stands_for_the_lost(
                    state, lost, lambda name: server.lookup(unreplicated_key(client.model_name, name))):
                return state, holder
        holder = backup_of(holder, hosts)
    return None


def holds_all_it_answered(state: Optional[MirrorState], lost: str, unreplicated: Optional[str]) -> bool:
    """Whether a mirror can stand for the lost primary incarnation `lost`: it was seeded by that incarnation and
    applied every op since, and that incarnation never said it went on without it (`unreplicated`: what it
    published under `unreplicated_key`; a backup cut off while alive keeps a mirror that stopped early)."""
    return state is not None and state.snapshot is not None and state.fed_by == lost and unreplicated != "1"


def stands_for_the_lost(state: Optional[MirrorState], lost_newest_first: List[str],
                        unreplicated_of: Callable[[str], Optional[str]]) -> bool:
    """Whether a mirror stands for the part as its lost incarnations (newest first) left it: fed throughout by one
    of them, none of which since said it went on without this backup. Those after the one that fed it never
    served the part, since a primary seeds its backup before its first reply or says it goes on alone: restarts
    that failed at once (while their host was cut off, say) do not cost the mirror."""
    for name in lost_newest_first:
        said = unreplicated_of(name)
        if holds_all_it_answered(state, name, said):
            return True
        if said == "1":
            return False
    return False


def _mirror_state(server, model: str, primary: int, backup: int) -> Optional[MirrorState]:
    """The backup's mirror of `primary`'s part, or None when the backup is gone too."""
    future = _calls.call_async(server.call_name_of("ps", backup), Endpoints.mirror_state, args=(model, primary))
    try:
        server.wait_watching(future, serving=("ps",))
        return future.wait()
    except ConnectionLost:
        return None
