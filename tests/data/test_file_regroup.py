"""A job restored onto another number of workers reads every record exactly once in every epoch: the old
workers' remainders go to the new workers, then the files are dealt anew. Checked by reading the files
through the old streams up to where each old worker stood, then through the new ones."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

from towerflow.data import FileStream, Handover
from towerflow.data.ctr_files import write_ctr
from towerflow.data.file_regroup import Plan, Resume, Span, StepPositions, plan_for
from towerflow.errors import DataError

ROWS = [1 << 20] + [1000] * 25
BATCH = 16
RECORDS = 660
STREAM = dict(shuffle_window=64, seed=11)


def _write(folder, fmt: str, sizes=(230, 170, 260), row_group: int = 50) -> str:
    """Files of unequal sizes (row groups of 50, the last of each file short), each record's id in C1."""
    g = torch.Generator().manual_seed(0)
    start = 0
    for n in sizes:
        cats = torch.randint(0, 1000, (n, 26), generator=g)
        cats[:, 0] = torch.arange(start, start + n)
        start += n
        write_ctr(str(folder), [(torch.randn(n, 13, generator=g), cats, (torch.rand(n, generator=g) < 0.3).float())],
                  fmt, row_group=row_group)
    return str(folder)


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("parquet"), "parquet")


def _read(stream: FileStream, batches: int):
    """(epoch, id) of every record of the stream's next `batches` batches."""
    out = []
    for batch in itertools.islice(iter(stream), batches):
        out += [(stream.epoch, i) for i in batch[1][:, 0].tolist()]
    return out


def _batches(stream: FileStream, batches: int):
    """The ids of the stream's next `batches` batches, a list per batch (the last batch of an epoch is short)."""
    return [batch[1][:, 0].tolist() for batch in itertools.islice(iter(stream), batches)]


def _read_through_first_new_epoch(stream: FileStream):
    """The stream's remainders and the whole first epoch of its own deal, as (epoch, id)."""
    out = []
    for batch in stream:
        own = stream.span == len(stream.plan.spans)
        if own and stream.epoch > stream.plan.first_epoch:
            break
        out += [(stream.epoch, i) for i in batch[1][:, 0].tolist()]
    return out


def _assert_each_record_once_per_epoch(read, last_epoch: int) -> None:
    by_epoch = collections.defaultdict(collections.Counter)
    for epoch, i in read:
        by_epoch[epoch][i] += 1
    for epoch in range(last_epoch + 1):
        twice = sorted(i for i, n in by_epoch[epoch].items() if n > 1)
        missing = sorted(set(range(RECORDS)) - set(by_epoch[epoch]))
        assert not twice and not missing, f"epoch {epoch}: read twice {twice[:5]}, never read {missing[:5]}"


def _old(folder, fmt, n, batches, earlier=()):
    read = []
    for w, c in enumerate(batches):
        read += _read(FileStream(folder, fmt, BATCH, ROWS, worker=w, num_workers=n, earlier=earlier, **STREAM), c)
    return read


@pytest.mark.parametrize("n,m,batches", [
    (3, 2, (5, 9, 1)),        # all mid-epoch (of 3 workers, each reads 16, 15 and 12 batches an epoch)
    (3, 2, (0, 0, 0)),        # stopped before any batch
    (3, 2, (16, 15, 12)),     # each at the end of its first epoch
    (3, 2, (33, 2, 20)),      # in different epochs: worker 1 lags two epochs behind worker 0
    (2, 3, (7, 12)),
    (2, 3, (0, 50)),          # worker 0 never started; worker 1 in its third epoch
    (2, 5, (21, 3)),
    (4, 1, (3, 9, 0, 11)),
])
def test_every_record_is_read_once_per_epoch_across_the_change_of_worker_count(parquet, n, m, batches):
    read = _old(parquet, "parquet", n, batches)
    starts = set()
    for j in range(m):
        stream = FileStream(parquet, "parquet", BATCH, ROWS, worker=j, num_workers=m, earlier=[Handover(n, batches)],
                            **STREAM)
        read += _read_through_first_new_epoch(stream)
        starts.add(stream.plan.first_epoch)
    assert len(starts) == 1  # every new worker deals the files anew from the same epoch
    _assert_each_record_once_per_epoch(read, starts.pop())


def test_a_job_changed_twice_before_its_remainders_were_read_still_reads_each_record_once(parquet):
    first, second = Handover(3, (5, 20, 1)), Handover(2, (4, 31))
    read = _old(parquet, "parquet", 3, first.batches)
    read += _old(parquet, "parquet", 2, second.batches, earlier=[first])
    starts = set()
    for j in range(4):
        stream = FileStream(parquet, "parquet", BATCH, ROWS, worker=j, num_workers=4, earlier=[first, second], **STREAM)
        read += _read_through_first_new_epoch(stream)
        starts.add(stream.plan.first_epoch)
    _assert_each_record_once_per_epoch(read, starts.pop())


def test_text_files_are_handed_on_too(tmp_path):
    folder = _write(tmp_path, "criteo", sizes=(100, 90, 120, 80, 150, 120))  # one unit per file
    batches = (4, 1, 6)
    read = _old(folder, "criteo", 3, batches)
    for j in range(2):
        read += _read_through_first_new_epoch(FileStream(folder, "criteo", BATCH, ROWS, worker=j, num_workers=2,
                                                         earlier=[Handover(3, batches)], **STREAM))
    _assert_each_record_once_per_epoch(read, 1)


def test_a_new_worker_reads_an_old_workers_remainder_batch_for_batch(parquet):
    """Shuffled with the old worker's seed: what it would have read had it gone on."""
    old = _batches(FileStream(parquet, "parquet", BATCH, ROWS, worker=2, num_workers=3, **STREAM), 12)  # its epoch
    new = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=[Handover(3, (16, 0, 6))],
                     **STREAM)
    assert new.plan == Plan(0, 2, (Span(2, 3, 0, 6),), 1)
    assert _batches(new, 6) == old[6:]


@pytest.mark.parametrize("done", [3, 11, 40])  # in the first remainder, in the second, in the new deal
def test_a_regrouped_worker_that_trained_n_batches_resumes_at_batch_n_plus_one(parquet, done):
    earlier = [Handover(3, (5, 9, 1))]
    whole = _batches(FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=earlier, **STREAM),
                     done + 6)
    by_clock = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, **STREAM,
                          resume=lambda: Resume(done, tuple(earlier)))
    assert _batches(by_clock, 6) == whole[done:]
    first = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=earlier, **STREAM)
    _batches(first, done)
    loaded = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=earlier, **STREAM)
    loaded.load_state_dict(first.state_dict())
    assert _batches(loaded, 6) == whole[done:]


def test_what_cannot_be_handed_on_is_named(parquet):
    with pytest.raises(DataError, match=r"expected the batches of each of its 3 workers"):
        FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=[Handover(3, (1, 2))])
    with pytest.raises(DataError, match="15 row groups / record batches for 16 workers: worker 15 would read nothing"):
        FileStream(parquet, "parquet", BATCH, ROWS, worker=15, num_workers=16, earlier=[Handover(3, (1, 2, 3))])
    saved = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=[Handover(3, (1, 2, 3))])
    with pytest.raises(DataError, match="cannot resume a stream restored as"):
        FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2).load_state_dict(saved.state_dict())
    with pytest.raises(DataError, match=r"a position of worker 0 of 3 cannot resume worker 0 of 2.*earlier="):
        saved.load_state_dict({"epoch": 0, "taken": 16, "worker": 0, "num_workers": 3})


def test_the_rule_without_files():
    per_epoch = {(0, 2): 16, (1, 2): 16, (0, 3): 12, (1, 3): 10, (2, 3): 10}.__getitem__
    plans = [plan_for(j, 3, [Handover(2, (6, 6))], lambda w, n: per_epoch((w, n))) for j in range(3)]
    assert plans == [Plan(0, 3, (Span(0, 2, 0, 6),), 1), Plan(1, 3, (Span(1, 2, 0, 6),), 1), Plan(2, 3, (), 1)]
    # old worker 1 is in its second epoch: worker 0 finishes its first, and both go on from epoch 2
    plans = [plan_for(j, 2, [Handover(3, (6, 12, 0))], lambda w, n: per_epoch((w, n))) for j in range(2)]
    assert plans == [Plan(0, 2, (Span(0, 3, 0, 6), Span(0, 3, 1, 0), Span(2, 3, 0, 0), Span(2, 3, 1, 0)), 2),
                     Plan(1, 2, (Span(1, 3, 1, 2),), 2)]


def test_a_checkpoint_of_replicas_stepping_together_says_how_many_read_the_files():
    """All-reduce replicas each train one batch per global step: a checkpoint of 2 at step 30 restored into 3
    hands on 30 batches of each old replica; the plan's batches count from that step."""
    saved = StepPositions().state(2)
    three = StepPositions.restored(saved, 30, 3)
    assert three == StepPositions((Handover(2, (30, 30)),), 30)
    assert three.resume(37) == Resume(7, (Handover(2, (30, 30)),))
    assert StepPositions.restored(three.state(3), 45, 3) == three  # the same count: kept as it was
    assert StepPositions.restored(three.state(3), 45, 1).earlier == (Handover(2, (30, 30)), Handover(3, (15, 15, 15)))
    assert StepPositions.restored(None, 30, 3) == StepPositions()  # a checkpoint that does not say


def test_a_regrouped_stream_saved_before_its_first_batch_resumes_at_its_plans_start(parquet):
    earlier = [Handover(3, (5, 9, 1))]
    saved = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=earlier, **STREAM).state_dict()
    loaded = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=earlier, **STREAM)
    loaded.load_state_dict(saved)
    fresh = FileStream(parquet, "parquet", BATCH, ROWS, worker=0, num_workers=2, earlier=earlier, **STREAM)
    assert _batches(loaded, 3) == _batches(fresh, 3)
