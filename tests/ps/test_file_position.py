"""A ps worker's place in its files from what every ps task counted: its own clock and, after a restore onto
another number of workers, the old workers' clocks, in batches."""

from __future__ import annotations

import pytest

from towerflow.data.file_regroup import Handover, Resume
from towerflow.errors import ParameterServerError
from towerflow.ps.messages import EarlierWorkers, Rejoined
from towerflow.ps.worker.file_position import resume_point


def test_each_old_workers_clock_is_the_most_any_ps_task_counted_in_batches():
    by_ps = [Rejoined(30, 6, False, (EarlierWorkers(3, (4, 7, 1)),)),
             Rejoined(30, 5, False, (EarlierWorkers(3, (5, 7, 0)),))]  # one push apart at the checkpoint
    assert resume_point(by_ps, 0, 1) == Resume(6, (Handover(3, (5, 7, 1)),))
    assert resume_point(by_ps, 9, 4) == Resume(36, (Handover(3, (20, 28, 4)),))  # its own count; 4 batches a push
    assert resume_point([Rejoined(3, 3, False)], 0, 1) == Resume(3)


def test_ps_tasks_restored_from_different_worker_counts_are_named():
    by_ps = [Rejoined(30, 6, False, (EarlierWorkers(3, (4, 7, 1)),)), Rejoined(30, 6, False, ())]
    with pytest.raises(ParameterServerError, match=r"different worker counts \(\[\(\), \(3,\)\]\)"):
        resume_point(by_ps, 0, 1)
