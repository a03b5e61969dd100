"""How the launcher ends tasks that do not end as planned.

Tasks that only serve the others (ps tasks running the launcher's ps program) end with the tasks they serve:
a training script that exits 0 before it joins the cluster (`--help`, a dry run) leaves the ps waiting for
workers that will never come, so the launcher stops it and the launch succeeds, instead of the ps timing out
with an error a minute later. A ps that ends by itself, or a task the user runs on ps slots themselves, is
left alone. A task that crashes in native code prints its Python stacks before it dies.
"""

from __future__ import annotations

import io
import sys
import time

import pytest

from towerflow.launch import supervisor
from towerflow.launch.supervisor import Supervisor
from towerflow.launch.task_process import TaskProcessSpec

pytestmark = pytest.mark.timeout(60)

EXITS_AT_ONCE = [sys.executable, "-c", "print('usage: train.py [--steps N]')"]
SERVES_FOREVER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]
ENDS_AFTER = [sys.executable, "-c", "import time; time.sleep(1.0)"]


def _run(tasks, grace=0.5, **options):
    out, err = io.StringIO(), io.StringIO()
    before, supervisor.SERVE_GRACE_S = supervisor.SERVE_GRACE_S, grace
    try:
        sup = Supervisor(tasks, out=out, err=err, **options)
        started = time.monotonic()
        code = sup.run()
        return code, time.monotonic() - started, out.getvalue(), err.getvalue(), sup
    finally:
        supervisor.SERVE_GRACE_S = before


def test_a_ps_left_waiting_by_workers_that_never_joined_is_stopped_and_the_launch_succeeds():
    code, took, out, err, sup = _run([
        TaskProcessSpec("worker", 0, EXITS_AT_ONCE, {}),
        TaskProcessSpec("worker", 1, EXITS_AT_ONCE, {}),
        TaskProcessSpec("ps", 0, SERVES_FOREVER, {}, serves_only=True),
    ])
    assert code == 0, err
    assert "usage: train.py" in out
    assert "every training task exited 0 and /job:ps/task:0 still ran after" in err and "such as with --help" in err
    assert took < 15
    assert all(r.proc.poll() is not None for r in sup._running)  # nothing outlives the launch


def test_a_ps_that_ends_by_itself_is_not_stopped():
    code, _, _, err, _ = _run([
        TaskProcessSpec("worker", 0, EXITS_AT_ONCE, {}),
        TaskProcessSpec("ps", 0, ENDS_AFTER, {}, serves_only=True),
    ], grace=10)
    assert code == 0 and "still ran after" not in err, err


def test_a_task_of_the_users_own_on_a_ps_slot_is_waited_for():
    """ps tasks running the user's program (ps_argv) may have work of their own after the workers: not stopped."""
    code, took, _, err, _ = _run([
        TaskProcessSpec("worker", 0, EXITS_AT_ONCE, {}),
        TaskProcessSpec("ps", 0, [sys.executable, "-c", "import time; time.sleep(2.0)"], {}),
    ], grace=0.2)
    assert code == 0 and "still ran after" not in err and took >= 1.5, err


def test_a_task_that_crashes_in_native_code_shows_where_its_python_was():
    """Aborts and segfaults bypass Python's error handling: the launcher has each task print its stacks then."""
    crash = [sys.executable, "-c", "import os\ndef load_the_batch():\n    os.abort()\nload_the_batch()"]
    code, _, _, err, _ = _run([TaskProcessSpec("worker", 0, crash, {})])
    assert code == 128 + 6, err
    assert "Fatal Python error: Aborted" in err and "load_the_batch" in err, err
    assert "/job:worker/task:0" in err and "killed by signal 6" in err, err


DIES = [sys.executable, "-c", "import sys; sys.exit(3)"]


@pytest.mark.parametrize("ps_replicas", [1, 2])
def test_a_ps_task_out_of_restarts_ends_the_job_unless_its_part_has_a_backup(ps_replicas):
    """--ps-replicas 2: its backup serves its part (the workers promote it), so the launcher leaves it lost and
    the job goes on to the workers' own end; without a backup the job ends there, naming it."""
    code, took, _, err, sup = _run([
        TaskProcessSpec("worker", 0, ENDS_AFTER, {}),
        TaskProcessSpec("ps", 0, DIES, {}, serves_only=True),
        TaskProcessSpec("ps", 1, SERVES_FOREVER, {}, serves_only=True),
    ], ps_replicas=ps_replicas)
    if ps_replicas == 1:
        assert code == 3 and "/job:ps/task:0" in err and "failed first" in err, err
        assert took < 1.0 + supervisor.STOP_GRACE_S  # the worker did not get to its end
    else:
        assert code == 0, err
        assert "/job:ps/task:0 (pid" in err and "exited with code 3, with no restarts left (0); leaving it lost" in err
        assert "/job:ps/task:0 had no restarts left and was left lost: its backup served its part" in err, err
    assert all(r.proc.poll() is not None for r in sup._running)


def test_the_last_ps_task_out_of_restarts_ends_the_job_even_with_backups():
    """With every ps task gone for good no part is served anywhere: the job ends, naming the last one."""
    code, _, _, err, _ = _run([
        TaskProcessSpec("worker", 0, SERVES_FOREVER, {}),
        TaskProcessSpec("ps", 0, DIES, {}, serves_only=True),
        TaskProcessSpec("ps", 1, [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(4)"], {},
                        serves_only=True),
    ], ps_replicas=2)
    assert code == 4 and "leaving it lost" in err and "/job:ps/task:1" in err, err


def test_ps_tasks_out_of_restarts_are_left_lost_while_another_is_left():
    """Three ps tasks, two gone for good one after the other: a promoted part gets a backup of its own, so whether
    a part is left is for the workers to say (they end the job when none is); the launcher leaves both lost."""
    code, _, _, err, sup = _run([
        TaskProcessSpec("worker", 0, ENDS_AFTER, {}),
        TaskProcessSpec("ps", 0, DIES, {}, serves_only=True),
        TaskProcessSpec("ps", 1, [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(4)"], {},
                        serves_only=True),
        TaskProcessSpec("ps", 2, SERVES_FOREVER, {}, serves_only=True),
    ], ps_replicas=2)
    assert code == 0, err
    assert err.count("with no restarts left (0); leaving it lost") == 2, err
    assert all(r.proc.poll() is not None for r in sup._running)
