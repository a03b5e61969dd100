"""A ps worker killed while reading its files goes on where it stood: its restarted incarnation reads the
batches after the ones the ps counted from it, so each record of its share is trained once per epoch (the
kill lands at a known batch: mid-epoch, and after the first epoch). A whole job restored from a checkpoint
goes on where the checkpoint's clocks say each worker stood, also on another number of workers (as does a
job of all-reduce replicas)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from _cluster_procs import HERE, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
TASK = str(HERE.parent / "ps" / "_files_task.py")
REGROUP_TASK = str(HERE.parent / "ps" / "_regroup_task.py")


def _write_files(folder: Path) -> None:
    """4 Parquet files of 256 records in row groups of 64, each record's id in C1."""
    from towerflow.data.ctr_files import write_ctr

    g = torch.Generator().manual_seed(0)
    for f in range(4):
        ids = torch.arange(f * 256, (f + 1) * 256)
        cats = torch.randint(0, 1000, (256, 26), generator=g)
        cats[:, 0] = ids
        write_ctr(str(folder), [(torch.randn(256, 13, generator=g), cats, (torch.rand(256, generator=g) < 0.3).float())],
                  "parquet", row_group=64)


def _batches(path: Path):
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()]


def _uninterrupted(data: Path, worker: int, n: int):
    from towerflow.data import FileStream

    stream = FileStream(str(data), "parquet", 32, [1 << 20] + [1000] * 25, worker=worker, num_workers=2,
                        shuffle_window=128, seed=3)
    return [b[1][:, 0].tolist() for b, _ in zip(stream, range(n))]


@pytest.mark.parametrize("kill_at", [5, 21])  # worker 1 reads 16 batches an epoch: mid-epoch, and in the second
def test_a_killed_worker_reads_on_from_the_batch_after_the_last_one_the_ps_counted(launcher, tmp_path, kill_at):
    data = tmp_path / "data"
    _write_files(data)
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "1", TASK,
                          str(tmp_path), str(data), "70", str(kill_at))
    wait_until(lambda: (tmp_path / "kill-me").exists() or run.popen.poll() is not None, 120, "worker 1 at its batch")
    assert (tmp_path / "kill-me").exists(), run.describe()
    os.kill(int((tmp_path / "kill-me").read_text()), signal.SIGKILL)
    assert run.wait(180) == 0, run.describe()

    first, second = _batches(tmp_path / "ids-1-0.txt"), _batches(tmp_path / "ids-1-1.txt")
    assert len(first) == kill_at and len(second) >= 3, run.describe()
    uninterrupted = _uninterrupted(data, 1, kill_at + len(second))
    assert first == uninterrupted[:kill_at]
    assert second == uninterrupted[kill_at:kill_at + len(second)]  # nothing trained twice, nothing skipped


def test_a_job_restored_from_a_checkpoint_reads_on_where_its_clocks_say(launcher, tmp_path):
    data, logdir = tmp_path / "data", tmp_path / "ckpt"
    _write_files(data)
    runs = []
    for label, steps in (("one", 40), ("two", 60)):
        (tmp_path / label).mkdir()
        run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", TASK, str(tmp_path / label),
                              str(data), str(steps), "0", str(logdir))
        assert run.wait(120) == 0, run.describe()
        runs.append(run)
    for worker in (0, 1):
        before, after = _batches(tmp_path / "one" / f"ids-{worker}-0.txt"), _batches(tmp_path / "two" / f"ids-{worker}-0.txt")
        uninterrupted = _uninterrupted(data, worker, len(before) + len(after) + 2)
        assert before == uninterrupted[:len(before)] and after, runs[1].describe()
        # the checkpoint at the chief's last step holds each worker's clock; a worker's pushes after it are lost
        # with the model's state they made, and its batches read again
        start = next((c for c in range(len(before), max(-1, len(before) - 3), -1)
                      if after == uninterrupted[c:c + len(after)]), None)
        assert start is not None, f"worker {worker}: job two started at none of batches {len(before) - 2}..{len(before)}"


def _stream(data: Path, worker: int, num_workers: int, epoch: int = 0):
    """Worker `worker` of `num_workers`'s batches as an uninterrupted job reads them, from epoch `epoch` on."""
    from towerflow.data import FileStream

    stream = FileStream(str(data), "parquet", 32, [1 << 20] + [1000] * 25, worker=worker, num_workers=num_workers,
                        shuffle_window=128, seed=3)
    stream.seek_batches(epoch * stream.batches_per_epoch(worker, num_workers))
    return stream, stream.batches_per_epoch(worker, num_workers)


def _first(stream, n: int):
    return [b[1][:, 0].tolist() for b, _ in zip(stream, range(n))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ps,old,new,trained", [
    (1, 3, 2, 4),  # ps workers, fewer after the restore; every old worker stops mid-epoch
    (0, 2, 3, 6),  # all-reduce replicas, more after it: the checkpoint says how many there were
])
def test_a_job_restored_on_another_number_of_workers_trains_each_record_of_the_epoch_once(launcher, tmp_path, ps, old,
                                                                                           new, trained):
    """Old worker w's unread batches of the epoch go to new worker w mod M, batch for batch as w would have
    read them; then the files are dealt anew over M from the next epoch."""
    data, logdir = tmp_path / "data", tmp_path / "ckpt"
    _write_files(data)
    for label, workers, batches in (("one", old, trained), ("two", new, 16)):
        (tmp_path / label).mkdir()
        run = launcher.python("-m", "towerflow", "launch", *(["--ps", str(ps)] if ps else []), "--workers", str(workers),
                              REGROUP_TASK, str(tmp_path / label), str(data), str(batches), str(logdir))
        assert run.wait(60) == 0, run.describe()
    before = {w: _batches(tmp_path / "one" / f"ids-{w}.txt") for w in range(old)}
    after = {j: _batches(tmp_path / "two" / f"ids-{j}.txt") for j in range(new)}
    epoch = []
    for w, batches in before.items():
        stream, per_epoch = _stream(data, w, old)
        assert batches == _first(stream, trained)
        epoch += [i for b in batches for i in b]
    for j, batches in after.items():
        expected = []
        for w in range(j, old, new):  # the rest of each old worker's epoch that falls to j
            stream, per_epoch = _stream(data, w, old)
            expected += _first(stream, per_epoch)[trained:]
        epoch += [i for b in batches[:len(expected)] for i in b]
        stream, _ = _stream(data, j, new, epoch=1)
        expected += _first(stream, len(batches) - len(expected))
        assert batches == expected, run.describe()
    assert sorted(epoch) == list(range(1024))  # every record of the epoch in progress trained once
