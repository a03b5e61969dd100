"""A stream read by a schema keeps the stream's guarantees: every record once per epoch across the workers,
list bags and all, and a saved position that resumes to the very batches an uninterrupted stream gives."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from towerflow.data import Categorical, CategoricalList, Dense, FileStream, Schema

SCHEMA = Schema("clk", (Dense("price", "log1p"), Categorical("userid", 1000, "string"),
                        CategoricalList("hist", 50)))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """600 records in 3 Parquet files of 2 row groups; record r has price r and a bag of r % 4 ids r + k."""
    out = tmp_path_factory.mktemp("named")
    for f in range(3):
        ids = range(200 * f, 200 * (f + 1))
        pq.write_table(pa.table({
            "clk": pa.array([r % 2 for r in ids], pa.int8()), "price": pa.array([float(r) for r in ids]),
            "userid": pa.array([f"u{r}" for r in ids]),
            "hist": pa.array([[r + k for k in range(r % 4)] for r in ids], pa.list_(pa.int64()))}),
            out / f"part-{f}.parquet", row_group_size=100)
    return str(out)


def _records(batch):
    """Each record as (record number, user row, its bag): the number read back from the price."""
    ids, offsets = batch["hist"]
    ends = torch.cat([offsets[1:], torch.tensor([len(ids)])]).tolist()
    numbers = torch.expm1(batch["price"].double()).round().long().tolist()
    return [(r, u, tuple(ids[s:e].tolist())) for r, u, s, e in zip(numbers, batch["userid"].tolist(),
                                                                    offsets.tolist(), ends)]


def test_every_record_is_read_once_per_epoch_across_two_workers_with_its_bag(folder):
    seen = []
    for worker in range(2):
        stream = FileStream(folder, batch_size=64, schema=SCHEMA, worker=worker, num_workers=2,
                            shuffle_window=150, seed=5)
        for batch in stream:
            if stream.epoch > 0:
                break
            seen += _records(batch)
    assert sorted(r for r, _, _ in seen) == list(range(600))
    assert all(bag == tuple((r + k) % 50 for k in range(r % 4)) for r, _, bag in seen)  # the bag of its record
    users = {r: u for r, u, _ in seen}
    assert len(set(users.values())) > 400  # hashed users spread over the rows


@pytest.mark.parametrize("stop", [1, 4, 7])
def test_a_resumed_stream_gives_the_batches_of_an_uninterrupted_one(folder, stop):
    def stream():
        return FileStream(folder, batch_size=64, schema=SCHEMA, worker=1, num_workers=2, shuffle_window=150, seed=5)

    whole = list(itertools.islice(iter(stream()), 12))  # past the end of the first epoch (5 batches)
    first = stream()
    list(itertools.islice(iter(first), stop))
    state = first.state_dict()
    second = stream()
    second.load_state_dict(state)
    resumed = list(itertools.islice(iter(second), 12 - stop))
    assert len(resumed) == len(whole[stop:])
    for a, b in zip(whole[stop:], resumed):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense) and torch.equal(a.ids, b.ids)
        assert all(torch.equal(x, y) for bag_a, bag_b in zip(a.bags, b.bags) for x, y in zip(bag_a, bag_b))


def test_a_job_restored_on_three_workers_reads_each_record_of_the_epoch_once_with_its_bag(folder):
    """Two workers stopped mid-epoch (after 2 and 3 batches of 64), the job restored on three: the old workers'
    remainders, then the new deal's first epoch, hold every record once per epoch, each with its own bag."""
    from towerflow.data import Handover

    read = []
    for worker, trained in enumerate((2, 3)):
        stream = FileStream(folder, batch_size=64, schema=SCHEMA, worker=worker, num_workers=2, shuffle_window=150,
                            seed=5)
        read += [(0, *r) for batch in itertools.islice(iter(stream), trained) for r in _records(batch)]
    for worker in range(3):
        stream = FileStream(folder, batch_size=64, schema=SCHEMA, worker=worker, num_workers=3, shuffle_window=150,
                            seed=5, earlier=[Handover(2, (2, 3))])
        for batch in stream:
            if stream.span == len(stream.plan.spans) and stream.epoch > stream.plan.first_epoch:
                break
            read += [(stream.epoch, *r) for r in _records(batch)]
    for epoch in (0, 1):
        numbers = sorted(r for e, r, _, _ in read if e == epoch)
        assert numbers == list(range(600)), f"epoch {epoch}: {len(numbers)} records, {len(set(numbers))} distinct"
    assert all(bag == tuple((r + k) % 50 for k in range(r % 4)) for _, r, _, bag in read)
