"""When a primary seeds its backup anew (`FreshSeeds` in `ps/server/replication/fresh_seeds.py`): by bytes of pushes
for a small state, by op count however small the ops, by a half-full ring, and never for a state too large to send
that often."""

from __future__ import annotations

from towerflow.ps.replication_messages import MIRROR_HOLD_BYTES, REFRESH_BYTES, REFRESH_FACTOR, REFRESH_OPS
from towerflow.ps.server.replication import fresh_seeds as _fresh_seeds
from towerflow.ps.server.replication.fresh_seeds import FreshSeeds


def _never() -> bool:
    raise AssertionError("the ring was asked although the counts decide")


def test_a_small_state_is_seeded_anew_after_its_bytes_of_pushes_and_counts_afresh(monkeypatch):
    monkeypatch.setattr(_fresh_seeds, "REFRESH_BYTES", 0)  # by the state's size alone
    seeds = FreshSeeds()
    seeds.seeded(1 << 20)
    assert seeds.after == REFRESH_FACTOR * (1 << 20)
    seeds.forwarded(seeds.after - 1)
    assert not seeds.due(lambda: False)
    seeds.forwarded(1)
    assert seeds.due(_never)
    seeds.seeded(1 << 20)
    assert (seeds.bytes, seeds.ops) == (0, 0) and not seeds.due(lambda: False)


def test_a_tiny_state_waits_for_the_floor_of_bytes_or_the_op_count():
    seeds = FreshSeeds()
    seeds.seeded(1000)
    assert seeds.after == REFRESH_BYTES
    for _ in range(REFRESH_OPS - 1):
        seeds.forwarded(1000)
    assert not seeds.due(lambda: False)
    seeds.forwarded()  # an op that is not a push counts too
    assert seeds.due(_never)


def test_a_half_full_ring_makes_it_due_before_the_counts_do():
    seeds = FreshSeeds()
    seeds.seeded(1000)
    seeds.forwarded(1000)
    assert seeds.due(lambda: True) and not seeds.due(lambda: False)


def test_a_state_too_large_to_send_that_often_is_never_seeded_anew():
    seeds = FreshSeeds()
    seeds.seeded(MIRROR_HOLD_BYTES // 2 // REFRESH_FACTOR + 1)
    assert seeds.after == 0
    for _ in range(2 * REFRESH_OPS):
        seeds.forwarded(1 << 20)
    assert not seeds.due(_never)
