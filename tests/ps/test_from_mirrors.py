"""Where the chief finds a lost ps task's part to restore it from (`--ps-replicas 2`), asked of fake ps tasks: its
backup's mirror, or the part itself where a backup serves it while promoted, further round the ring when the
backup that served it first was lost too."""

from __future__ import annotations

import types

from towerflow.cluster.spec import ClusterSpec
from towerflow.ps.replication_messages import MirrorState, backup_ring
from towerflow.ps.worker import from_mirrors


def _client(num_ps: int, incarnation: int = 1, hosts=None):
    hosts = hosts or ["localhost"] * num_ps
    server = types.SimpleNamespace(membership=types.SimpleNamespace(incarnation_of=lambda job, task: incarnation),
                                   lookup=lambda key: None,
                                   cluster=ClusterSpec({"ps": [f"{h}:{2222 + i}" for i, h in enumerate(hosts)]}))
    return types.SimpleNamespace(server=server, model_name="model", layout=types.SimpleNamespace(num_ps=num_ps))


def _ask(monkeypatch, states):
    """Each ps task answers `mirror_state` with `states[task]` (None: it is gone); the tasks asked, in order."""
    asked = []

    def mirror_state(server, model, primary, holder):
        asked.append(holder)
        return states.get(holder)
    monkeypatch.setattr(from_mirrors, "_mirror_state", mirror_state)
    return asked


SNAPSHOT = object()


def test_the_backups_mirror_fed_by_the_lost_incarnation_is_found_with_one_call(monkeypatch):
    asked = _ask(monkeypatch, {1: MirrorState(SNAPSHOT, "ps:0", 7)})
    state, holder = from_mirrors._find_mirror(_client(3), 0, {0})
    assert (state.snapshot, holder, asked) == (SNAPSHOT, 1, [1])


def test_a_part_served_further_round_the_ring_is_found_there(monkeypatch):
    """ps 0's part went to ps 1 (promoted), then, ps 1 lost too, to ps 2: ps 1 restarted empty holds nothing of it."""
    asked = _ask(monkeypatch, {1: MirrorState(None, None, 0), 2: MirrorState(SNAPSHOT, "ps:1", 40, served=True)})
    state, holder = from_mirrors._find_mirror(_client(3), 0, {0})
    assert (state.snapshot, holder, asked) == (SNAPSHOT, 2, [1, 2])


def test_an_empty_backup_is_not_asked_and_the_search_goes_on(monkeypatch):
    asked = _ask(monkeypatch, {2: MirrorState(SNAPSHOT, "ps:1", 40, served=True)})
    state, holder = from_mirrors._find_mirror(_client(4), 0, {0, 1})
    assert (holder, asked) == (2, [2])


def test_only_a_served_part_counts_beyond_the_backup(monkeypatch):
    """A mirror further on was fed by a backup, not by the lost task: it stands for the part only while served."""
    asked = _ask(monkeypatch, {1: None, 2: MirrorState(SNAPSHOT, "ps:1", 40), 3: None})
    assert from_mirrors._find_mirror(_client(4), 0, {0}) is None
    assert asked == [1, 2, 3]  # round the ring once, never the lost task itself


def test_the_ring_takes_the_hosts_in_turn_so_that_a_backup_is_on_another_host():
    assert backup_ring(["a"] * 4) == (0, 1, 2, 3)  # one host: the next task, as always
    assert backup_ring(["a", "a", "b", "b"]) == (0, 2, 1, 3)  # each part mirrored on the other host
    assert backup_ring(["a", "b", "a", "b"]) == (0, 1, 2, 3)
    assert backup_ring(["a", "a", "b"]) == (0, 2, 1)  # 1's backup is 0, on its host: no third host to take it
    ring = backup_ring(["h0", "h1", "h2", "h0", "h1", "h2", "h0"])
    assert sorted(ring) == list(range(7))
    same_host = [(t, n) for t, n in zip(ring, ring[1:] + ring[:1]) if t % 3 == n % 3]
    assert same_host == [(6, 0)]  # three tasks on h0 among seven: one of its parts must stay on it


def test_with_two_ps_tasks_on_each_host_the_lost_tasks_mirror_is_sought_on_the_other_host(monkeypatch):
    """ps 0 and ps 1 on one host, ps 2 and ps 3 on another: ps 0's part is mirrored on ps 2, so the chief finds it
    there when the first host is lost with both its tasks."""
    asked = _ask(monkeypatch, {2: MirrorState(SNAPSHOT, "ps:0", 7)})
    state, holder = from_mirrors._find_mirror(_client(4, hosts=["a", "a", "b", "b"]), 0, {0, 1})
    assert (state.snapshot, holder, asked) == (SNAPSHOT, 2, [2])
