"""Embedding tables on the parameter servers, on a real cluster: 2 ps + 2 workers, one launch.

`_sparse_scenarios.py` trains a model with an nn.Embedding and an nn.EmbeddingBag table
(sparse=True) per scenario, then one with a HashEmbedding; what the chief read back is compared
here with plain PyTorch in one process.
"""

from __future__ import annotations

import json

import pytest
import torch

import _sparse_scenarios as sc
from _launch import launch

from towerflow.monitoring.metrics import read_metrics

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps-sparse")
    launch(["--ps", "2", "--workers", "2", "--logdir", str(out / "logs"), sc.__file__, "--out", str(out)], timeout=240)
    workers = [json.loads((out / f"worker-{i}.json").read_text()) for i in range(2)]
    return json.loads((out / "chief.json").read_text()), workers, read_metrics(str(out / "logs"))


def _reference(make_optimizer):
    """Plain PyTorch in one process: nn.Embedding(sparse=True) and a torch optimizer over the mean of the
    two workers' losses, step by step (what sync mode with every replica computes)."""
    model = sc.Tiny()
    optimizer = make_optimizer(model)
    for step in range(sc.STEPS):
        optimizer.zero_grad()
        losses = []
        for w in range(2):
            users, items, offsets, target = sc.batch(step, w)
            losses.append(torch.nn.functional.mse_loss(model(users, items, offsets), target))
        (sum(losses) / 2).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("name,make_optimizer", [
    ("sync_mod_adagrad", lambda m: torch.optim.Adagrad(m.parameters(), lr=0.3)),
    ("sync_div_sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.5)),
])
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's Adagrad, the reference
def test_sync_tables_on_two_ps_tasks_train_as_plain_pytorch_does(results, name, make_optimizer):
    chief = results[0]
    ref = _reference(make_optimizer)
    got = chief[name]
    assert got["global_step"] == sc.STEPS
    for table in ("user", "items"):
        want = getattr(ref, table).weight.detach()
        assert torch.allclose(torch.tensor(got["tables"][table]), want, atol=1e-5), table
    assert torch.allclose(torch.tensor(got["variables"]["head.weight"]), ref.head.weight.detach(), atol=1e-5)
    held = {t: m["tables"] for t, m in got["ps"].items()}
    rows = {t: {name: m["rows"] for name, m in tables.items()} for t, tables in held.items()}
    assert rows["/job:ps/task:0"]["user"] + rows["/job:ps/task:1"]["user"] == sc.USERS  # each row on one ps task


def test_only_the_rows_a_batch_touches_travel(results):
    workers = results[1]
    for w in workers:
        m = w["async_adam_meta"]
        unique = sum(s["user"] + s["items"] for s in m["looked_up"])
        row_bytes = unique * (sc.DIM * 4 + 4)  # rows (float32) and their int32 keys, each way
        dense = (2 * sc.DIM + 1) * 4  # the head: the only dense variables
        assert sum(m["bytes_pulled"].values()) == row_bytes + (sc.STEPS + 1) * dense
        assert sum(m["bytes_pushed"].values()) == row_bytes + sc.STEPS * dense


def test_meta_tables_are_drawn_on_the_ps_and_trained_with_lazy_adam(results):
    chief = results[0]
    got = chief["async_adam_meta"]
    user = torch.tensor(got["tables"]["user"])
    assert user.shape == (sc.USERS, sc.DIM) and 0.5 < float(user.std()) < 1.5  # N(0, 1), as nn.Embedding draws
    assert got["global_step"] == 2 * sc.STEPS  # async: every push is an update


def test_a_hash_vocabulary_admits_and_evicts_as_configured(results):
    chief = results[0]
    got = chief["hash"]
    assert got["global_step"] == 4
    total = {k: sum(m["tables"]["ids"][k] for m in got["ps"].values()) for k in ("rows", "admitted", "evicted", "pending")}
    # -BASE (every step of worker 0) and -BASE-1 (worker 1, steps 0-1) reach 2 sightings at step 1, BASE at step 3;
    # -BASE-1 is then untouched from global step 2 and goes at global step 4; 11 ids were seen once only
    assert total == {"rows": 2, "admitted": 3, "evicted": 1, "pending": 11}


def test_each_ps_task_records_its_rows_admissions_and_evictions_in_metrics_jsonl(results):
    chief, _, records = results
    final = {}
    for r in records:
        if r.get("role") == "ps" and r.get("model") == "hash":
            final[r["task"]] = r
    assert sorted(final) == ["ps:0", "ps:1"]
    want = {k: sum(m["tables"]["ids"][k] for m in chief["hash"]["ps"].values()) for k in ("rows", "admitted", "evicted")}
    assert {k: sum(r[k] for r in final.values()) for k in want} == want == {"rows": 2, "admitted": 3, "evicted": 1}
