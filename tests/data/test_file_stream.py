"""Training data from files: every record once per epoch across workers, positions that resume exactly,
Criteo's text read as Criteo's users read it, and bad input named."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from towerflow.data import synthetic_ctr
from towerflow.data.ctr_files import write_ctr
from towerflow.data.file_stream import FileStream
from towerflow.errors import DataError

ROWS = [1000] * 26


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same 2,000 synthetic records as Parquet (4 files of 5 row groups), Arrow IPC and Criteo TSV (4 files)."""
    data = synthetic_ctr(1000, seed=0, test_size=10)
    made = {}
    for fmt in ("parquet", "arrow", "criteo"):
        folder = tmp_path_factory.mktemp(fmt)
        stream = data.batches(250, seed=1)
        for _ in range(4):
            write_ctr(str(folder), [next(stream), next(stream)], fmt, row_group=100)
        made[fmt] = str(folder)
    return made


def _rows(batch):
    dense, cats, labels = batch
    return [tuple(d.tolist()) + tuple(c.tolist()) + (float(label),) for d, c, label in zip(dense, cats, labels)]


def _read_all(folder, fmt, workers, **kw):
    """Every worker's first epoch: its batches until the first one of the next epoch."""
    out = []
    for w in range(workers):
        s = FileStream(folder, fmt, 64, ROWS, worker=w, num_workers=workers, **kw)
        got = []
        for batch in s:
            if s.epoch > 0:
                break
            got += _rows(batch)
        out.append(got)
    return out


@pytest.mark.parametrize("fmt,workers", [("parquet", 2), ("parquet", 3), ("arrow", 2), ("criteo", 2)])
def test_every_record_is_read_once_per_epoch_across_the_workers(files, fmt, workers):
    everything = _read_all(files[fmt], fmt, 1)[0]
    parts = _read_all(files[fmt], fmt, workers, shuffle_window=300, seed=7)
    union = [r for p in parts for r in p]
    assert len(union) == len(set(union)) == 2000
    assert set(union) == set(everything)


def test_a_resumed_stream_continues_exactly_where_the_first_stopped(files):
    whole = FileStream(files["parquet"], "parquet", 64, ROWS, shuffle_window=300, seed=5)
    expected = [b for b in itertools.islice(iter(whole), 25)]  # past the first epoch's 2,000 records
    first = FileStream(files["parquet"], "parquet", 64, ROWS, shuffle_window=300, seed=5)
    head = list(itertools.islice(iter(first), 7))
    position = first.state_dict()
    resumed = FileStream(files["parquet"], "parquet", 64, ROWS, shuffle_window=300, seed=5)
    resumed.load_state_dict(position)
    tail = list(itertools.islice(iter(resumed), 25 - 7))
    for got, want in zip(head + tail, expected):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_position_of_another_worker_count_is_refused(files):
    s = FileStream(files["parquet"], "parquet", 64, ROWS, worker=0, num_workers=2)
    with pytest.raises(DataError, match="a position of worker 0 of 3 cannot resume worker 0 of 2"):
        s.load_state_dict({"epoch": 0, "taken": 64, "worker": 0, "num_workers": 3})


def test_parquet_and_arrow_give_back_the_records_as_written(files):
    data = synthetic_ctr(1000, seed=0, test_size=10)
    stream = data.batches(250, seed=1)
    written = next(stream)
    for fmt in ("parquet", "arrow"):
        dense, cats, labels = next(iter(FileStream(files[fmt], fmt, 250, ROWS)))
        assert torch.equal(dense, written[0]) and torch.equal(cats, written[1]) and torch.equal(labels, written[2])


def test_criteo_text_is_read_as_criteo_users_read_it(tmp_path):
    (tmp_path / "day_0").write_text(
        "1\t0\t5\t\t-2" + "\t1" * 9 + "\t0000000a\t\t" + "\t".join(["ff"] * 24) + "\n"
        "0" + "\t3" * 13 + "\t" + "\t".join(["00000001"] * 26) + "\n"
    )
    dense, cats, labels = next(iter(FileStream(str(tmp_path), "criteo", 2, [7] * 26)))
    assert labels.tolist() == [1.0, 0.0]
    assert dense[0, :4].tolist() == pytest.approx([0.0, math.log(6), 0.0, 0.0])  # empty: 0; negative: 0
    assert dense[1].tolist() == pytest.approx([math.log(4)] * 13)
    assert cats[0, :3].tolist() == [10 % 7, 0, 255 % 7]  # hex values into each table's rows; empty: row 0
    assert cats[1].tolist() == [1] * 26


def test_stripped_trailing_fields_are_missing_values_and_an_overlong_line_is_named(tmp_path):
    good = "1" + "\t1" * 13 + "\t" + "\t".join(["0a"] * 26) + "\n"
    (tmp_path / "day_0").write_text(good + "0\t5\t2\n" + good)  # a copy's line with its trailing fields stripped
    dense, cats, labels = next(iter(FileStream(str(tmp_path), "criteo", 3, [7] * 26)))
    assert labels.tolist() == [1.0, 0.0, 1.0]
    assert dense[1, :3].tolist() == pytest.approx([math.log(6), math.log(3), 0.0])  # the missing ones as 0
    assert cats[1].tolist() == [0] * 26  # missing categoricals: row 0
    (tmp_path / "day_0").write_text(good + good.replace("\n", "\t0a\n") + good)
    with pytest.raises(DataError, match=r"day_0, line 2: 41 fields, expected 40"):
        list(itertools.islice(iter(FileStream(str(tmp_path), "criteo", 2, [7] * 26)), 2))
    s = FileStream(str(tmp_path), "criteo", 2, [7] * 26, on_bad_record="skip")
    dense, cats, labels = next(iter(s))
    assert len(labels) == 2 and s.bad_records == 1


def test_a_categorical_that_is_not_hex_is_named_by_file_line_and_column(tmp_path):
    good = "1" + "\t1" * 13 + "\t" + "\t".join(["0a"] * 26) + "\n"
    (tmp_path / "day_0").write_text(good + "1" + "\t1" * 13 + "\t" + "\t".join(["0a"] * 25 + ["xyz"]) + "\n")
    with pytest.raises(DataError, match=r"day_0, line 2, column 'C26': 'xyz' is not a hex number"):
        next(iter(FileStream(str(tmp_path), "criteo", 1, [7] * 26)))
    s = FileStream(str(tmp_path), "criteo", 2, [7] * 26, on_bad_record="skip")
    dense, cats, labels = next(iter(s))
    assert len(labels) == 1 and s.bad_records == 1


def test_an_empty_glob_and_too_few_files_are_named(tmp_path, files):
    with pytest.raises(DataError, match="no files match .*nothing-\\*.parquet"):
        FileStream(str(tmp_path / "nothing-*.parquet"), "parquet", 8, ROWS)
    with pytest.raises(DataError, match="4 text files for 5 workers: worker 4 would read nothing"):
        FileStream(files["criteo"], "criteo", 8, ROWS, worker=4, num_workers=5)


@pytest.mark.parametrize("fmt", ["parquet", "criteo"])
def test_memory_is_bounded_by_the_window_not_by_the_data(tmp_path, fmt):
    """Four epochs of 42 MB of records (Parquet; 21 MB of Criteo text, whose parsing is the slow part) through a
    4,096-record window: the peak grows no more than for one (Criteo text: pyarrow's allocator keeps about 100 MB it
    freed, the same for one epoch or many)."""
    import os
    import subprocess
    import sys

    from towerflow.data import write_ctr_files

    per_epoch = 160_000 if fmt == "parquet" else 80_000
    write_ctr_files(synthetic_ctr(1000, seed=0, test_size=10), str(tmp_path), fmt, files=8,
                    records_per_file=per_epoch // 8)
    code = (
        "import resource, sys\n"
        "from towerflow.data import FileStream\n"
        f"s = FileStream({str(tmp_path / 'train')!r}, {fmt!r}, 512, [1000] * 26, shuffle_window=4096)\n"
        "before, n = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 0\n"
        "for batch in s:\n"
        "    n += len(batch[2])\n"
        "    if s.epoch >= int(sys.argv[1]): break\n"
        "print(n, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    grown = {}
    for epochs in (1, 4):
        out = subprocess.run([sys.executable, "-c", code, str(epochs)], capture_output=True, text=True, env=env,
                             timeout=120, check=True)
        records, grown[epochs] = out.stdout.split()
        assert int(records) >= per_epoch * epochs
        grown[epochs] = float(grown[epochs])
    data_mb = per_epoch * (13 * 4 + 26 * 8 + 4) / 2**20  # what one epoch's records take as tensors
    assert grown[4] <= grown[1] + 8, grown
    if fmt == "parquet":
        assert grown[4] < data_mb, (grown, data_mb)


@pytest.mark.parametrize("fmt", ["parquet", "criteo"])
@pytest.mark.parametrize("done", [7, 40])  # inside the first epoch (16 batches of 64 per worker), and in the third
def test_a_worker_that_trained_n_batches_resumes_at_batch_n_plus_one(files, fmt, done):
    """What a restarted worker does: its strategy says how many batches it trained, and its files go on there."""
    def stream(**kw):
        return FileStream(files[fmt], fmt, 64, ROWS, worker=1, num_workers=2, shuffle_window=300, seed=2, **kw)

    uninterrupted = list(itertools.islice(iter(stream()), done + 3))
    resumed = list(itertools.islice(iter(stream(resume=lambda: done)), 3))
    for got, want in zip(resumed, uninterrupted[done:]):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_job_restored_from_a_checkpoint_reads_on_from_its_step(files, tmp_path):
    """One process (as every replica of an all-reduce group): the restored global step is the batches read."""
    import towerflow

    def run(last_step):
        strategy = towerflow.OneDeviceStrategy("/cpu:0")
        model, optimizer = strategy.setup(torch.nn.Linear(13, 1), torch.optim.SGD(torch.nn.Linear(13, 1).parameters(), 0.1))
        stream = strategy.distribute_files(files["parquet"], "parquet", 64, ROWS, shuffle_window=300, seed=4)
        seen = []
        with towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, logdir=str(tmp_path),
                                                hooks=[towerflow.StopAtStepHook(last_step=last_step)], save_checkpoint_steps=10,
                                                save_checkpoint_secs=None, log_step_count_steps=0, progress=False,
                                                save_summaries_steps=0) as session:
            for dense, cats, labels in stream:
                if session.should_stop():
                    break
                seen.append(cats[:, 0].tolist())

                def step():
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(model(dense).squeeze(1), labels).backward()
                    optimizer.step()

                session.run(step)
        return seen

    first = run(40)  # 40 steps: past the first epoch's 32 batches, checkpointed at 40
    resumed = run(45)
    expected = FileStream(files["parquet"], "parquet", 64, ROWS, shuffle_window=300, seed=4)
    uninterrupted = [b[1][:, 0].tolist() for b, _ in zip(expected, range(45))]
    assert first == uninterrupted[:40] and resumed == uninterrupted[40:45]


def test_the_metrics_records_carry_where_the_worker_stands_in_its_files(files, tmp_path):
    import towerflow

    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    model, optimizer = strategy.setup(torch.nn.Linear(13, 1), torch.optim.SGD(torch.nn.Linear(13, 1).parameters(), 0.1))
    assert strategy.data_position() == {}
    stream = strategy.distribute_files(files["parquet"], "parquet", 100, ROWS)
    with towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, progress=False) as session:
        for _, _ in zip(range(3), stream):
            pass
        assert session.extra_metrics() == {"data_epoch": 0, "data_records": 300, "data_epoch_records": 2000}
