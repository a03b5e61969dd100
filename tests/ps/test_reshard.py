"""A ps checkpoint written with N ps tasks restores onto M: every dense element, table row and optimizer
state lands where the new layout puts it (ShardServices in one process, no cluster)."""

from __future__ import annotations

import pytest
import torch

from towerflow.ps.layout import plan_layout
from towerflow.ps.messages import EarlierWorkers, RowPush
from towerflow.ps.messages import Ticket
from towerflow.ps.policies import AsyncPolicy
from towerflow.ps.server.service import ShardService
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_optimizers import SparseAdagrad
from towerflow.ps.tables.table_shards import TableShards
from towerflow.ps.worker.reshard import needs_reshard, reshard

OPT = SparseAdagrad(lr=0.5)


def _params():
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(6, 4, generator=g), "a.bias": torch.randn(6, generator=g),
            "b.weight": torch.randn(2, 6, generator=g)}


def _specs(n, strategy="mod"):
    return {"fixed": TableSpec("fixed", 23, 3, torch.float32, n, strategy, seed=1),
            "hashed": TableSpec("hashed", None, 3, torch.float32, n, "hash", seed=1)}


def _cluster(n, strategy="mod"):
    params, specs = _params(), _specs(n, strategy)
    layout = plan_layout(params, n)
    services = []
    for t in range(n):
        packed = layout.pack(t, params)
        tables = TableShards(t, list(specs.values()), OPT)
        services.append(ShardService(layout.on_task(t), packed, torch.optim.Adagrad, {"lr": 0.1}, AsyncPolicy(), 1, tables))
    return layout, specs, services


def _train(layout, specs, services, steps=3):
    """A few pushes touching some rows of both tables (hash ids admitted on first sight)."""
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for t, service in enumerate(services):
            grads = [torch.randn(n, generator=g) for n in layout.flat_sizes(t).values()]
            rows = {}
            for name, spec in specs.items():
                ids = torch.unique(torch.randint(0, 23, (6,), generator=g) if not spec.is_hash else
                                   torch.randint(-10**9, 10**9, (4,), generator=g))
                shard, local = spec.route(ids)
                keys = local[shard == t]
                service.tables.read([name], [keys], 0)
                rows[name] = (keys, torch.randn(keys.numel(), 3, generator=g))
            push = RowPush(tuple(rows), tuple(k for k, _ in rows.values()), tuple(v for _, v in rows.values()))
            service.push(0, Ticket(service.coordinator.global_step), grads, None, push)


def _everything(layout, specs, services):
    """Dense values, Adagrad sums, and every table row with its state, by global id."""
    flats = {}
    for t, s in enumerate(services):
        dtypes = list(layout.flat_sizes(t))
        flats.update(layout.unpack(t, dict(zip(dtypes, s.flats))))
        state = s.optimizer.state_dict()["state"]
        flats.update({f"sum:{k}": v for k, v in layout.unpack(t, dict(zip(dtypes, [state[i]["sum"] for i in range(len(dtypes))]))).items()})
    rows = {}
    for t, s in enumerate(services):
        for name, store in s.tables.stores.items():
            ids, values, state = store.export()
            for i, gid in enumerate(specs[name].global_ids(t, ids).tolist()):
                rows[(name, gid)] = (values[i], state["sum"][i])
    return flats, rows


@pytest.mark.parametrize("n,m,strategy", [(2, 1, "mod"), (2, 3, "div"), (3, 2, "mod")])
def test_a_checkpoint_of_n_ps_tasks_restores_onto_m(n, m, strategy):
    layout, specs, services = _cluster(n, strategy)
    _train(layout, specs, services)
    for s in services:  # restored before from a checkpoint of 2 workers: the new workers read on from their clocks
        s.coordinator.earlier = (EarlierWorkers(2, (3, 4)),)
    parts = {str(t): s.state_dict() for t, s in enumerate(services)}
    new_layout, new_specs, new_services = _cluster(m, strategy)
    assert needs_reshard(parts, m, new_specs)
    new_parts = reshard(parts, layout, new_layout, new_specs, OPT)
    for t, s in enumerate(new_services):
        s.load_state_dict(new_parts[t])
    before_flat, before_rows = _everything(layout, specs, services)
    after_flat, after_rows = _everything(new_layout, new_specs, new_services)
    by_var = lambda flats, lay: {v: lay.assemble(v, [flats[s.name] for s in lay.shards_of(v)]) for v in lay.variables}  # noqa: E731
    for key in ("", "sum:"):
        b = by_var({k[len(key):]: v for k, v in before_flat.items() if k.startswith(key) and (key or ":" not in k)}, layout)
        a = by_var({k[len(key):]: v for k, v in after_flat.items() if k.startswith(key) and (key or ":" not in k)}, new_layout)
        assert all(torch.equal(a[v], b[v]) for v in b), key
    assert before_rows.keys() == after_rows.keys() and len(before_rows) > 23  # every fixed row, every admitted hash id
    assert all(torch.equal(before_rows[k][0], after_rows[k][0]) and torch.equal(before_rows[k][1], after_rows[k][1])
               for k in before_rows)
    assert {s.coordinator.global_step for s in new_services} == {max(s.coordinator.global_step for s in services)}
    assert {s.rejoin(0, restarted=False).earlier for s in new_services} == {(EarlierWorkers(2, (3, 4)),)}


def test_the_same_number_of_ps_tasks_needs_no_reshard():
    layout, specs, services = _cluster(2)
    assert not needs_reshard({str(t): s.state_dict() for t, s in enumerate(services)}, 2, specs)

