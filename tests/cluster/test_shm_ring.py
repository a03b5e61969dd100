"""The same-host ring: a record written is the reader's once its ticket is, in order, even after its writer is gone;
a full ring refuses a record instead of overwriting one not taken; a reader's close reaches the writer."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from towerflow.cluster.link import shm_ring

pytestmark = pytest.mark.skipif(not shm_ring.supported(), reason="the ring's tickets need x86-64's store order")

SPECS = ((6, torch.float32), (3, torch.int64))


def _record(i: int):
    return [torch.full((6,), float(i)), torch.full((3,), i, dtype=torch.int64)], (float(i), i * 0.5)


def _taken(reader: shm_ring.RingReader) -> list:
    got = []
    reader.take(lambda values, tensors: got.append((values, [t.clone() for t in tensors])))
    return got


def test_records_are_read_in_order_and_a_full_ring_refuses_more(tmp_path):
    writer = shm_ring.RingWriter(SPECS, 2, 3, directory=str(tmp_path))
    reader = shm_ring.RingReader(writer.offer)
    writer.unlink()
    assert os.listdir(tmp_path) == []  # the names go once both ends mapped the files
    assert _taken(reader) == []
    for i in range(3):
        assert writer.put(*_record(i))
    assert not writer.put(*_record(3))  # every slot holds a record not taken yet: nothing is overwritten
    got = _taken(reader)
    assert [values for values, _ in got] == [(0.0, 0.0), (1.0, 0.5), (2.0, 1.0)]
    assert all(torch.equal(tensors[0], torch.full((6,), float(i))) for i, (_, tensors) in enumerate(got))
    for i in range(3, 6):  # the slots are free again, and the ring wraps
        assert writer.put(*_record(i))
    assert [values[0] for values, _ in _taken(reader)] == [3.0, 4.0, 5.0]


def _write_and_die(offer_path: str, queue) -> None:
    writer = shm_ring.RingWriter(SPECS, 2, 4, directory=offer_path)
    queue.put(writer.offer)
    queue.get()  # the reader mapped the files
    writer.put(*_record(7))
    writer.put(*_record(8))
    os._exit(0)  # no clean-up: as a SIGKILL


def test_what_a_dead_writer_wrote_is_still_there_for_the_reader(tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=_write_and_die, args=(str(tmp_path), queue))
    process.start()
    try:
        offer = queue.get(timeout=30)
        reader = shm_ring.RingReader(offer)
        queue.put("mapped")
        process.join(30)
        assert process.exitcode == 0
        assert [values for values, _ in _taken(reader)] == [(7.0, 3.5), (8.0, 4.0)]
    finally:
        if process.is_alive():
            process.kill()
        for name in os.listdir(tmp_path):
            os.unlink(tmp_path / name)


def test_a_reader_that_closes_the_ring_is_seen_by_its_writer(tmp_path):
    writer = shm_ring.RingWriter(SPECS, 2, 2, directory=str(tmp_path))
    reader = shm_ring.RingReader(writer.offer)
    writer.unlink()
    assert not writer.closed
    reader.close()
    assert writer.closed


def test_files_left_by_a_killed_writer_are_swept_by_the_next_one(tmp_path):
    """A writer killed between creating its files and the reader's mapping leaves them named; the next writer on
    the host removes the files of creators no longer running, and only those."""
    gone = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    gone.start()
    gone.join(30)
    left = tmp_path / f"towerflow-ring-{gone.pid}-{'a' * 32}.d0"
    mine = tmp_path / f"towerflow-ring-{os.getpid()}-{'b' * 32}.d0"
    other = tmp_path / "towerflow-notes.txt"
    for path in (left, mine, other):
        path.write_bytes(b"x")
    writer = shm_ring.RingWriter(SPECS, 2, 2, directory=str(tmp_path))
    assert not left.exists() and mine.exists() and other.exists()
    writer.unlink()
