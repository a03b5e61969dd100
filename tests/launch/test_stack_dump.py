"""A hung launch says where it hangs: SIGUSR1 to the launcher has every task print its threads' stacks."""

from __future__ import annotations

import os

import pytest

from tests.ps._launch import LaunchFailed, condensed_stacks, launch

HUNG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hung_task.py")
pytestmark = pytest.mark.timeout(120)


def test_a_launch_past_its_deadline_shows_each_tasks_stack():
    with pytest.raises(LaunchFailed) as failed:
        launch(["--workers", "2", HUNG], timeout=20)
    message = str(failed.value)
    stacks = message.split("where each task waited:")[1].split("its output until then:")[0]
    for task in ("[worker:0]", "[worker:1]"):
        assert any(line.startswith(task) and "thread" in line.lower() for line in stacks.splitlines()), stacks
    assert "_hung_task.py" in stacks and "wait_here" in stacks, stacks


def test_condensed_stacks_keep_each_busy_threads_innermost_own_frames():
    dump = "\n".join([
        "[ps:0] Thread 0x00007f01 (most recent call first):",
        '[ps:0]   File "/usr/lib/python3.11/threading.py", line 324 in wait',
        '[ps:0]   File "/repo/src/towerflow/ps/server/mirror.py", line 80 in wait_applied',
        '[ps:0]   File "/repo/src/towerflow/ps/server/mirror.py", line 90 in state',
        '[ps:0]   File "/repo/src/towerflow/ps/server/endpoints.py", line 120 in mirror_state',
        "[ps:0] ",
        "[ps:0] Thread 0x00007f03 (most recent call first):",
        '[ps:0]   File "/usr/lib/python3.11/concurrent/futures/thread.py", line 81 in _worker',
        '[ps:0]   File "/usr/lib/python3.11/threading.py", line 982 in run',
        "[ps:0] Current thread 0x00007f02 (most recent call first):",
        '[ps:0]   File "/repo/src/towerflow/cluster/server.py", line 264 in join',
        "[worker:0] an ordinary line",
    ])
    assert condensed_stacks(dump, frames=2).splitlines() == [
        "[ps:0] Thread 0x00007f01:",
        "    mirror.py, line 80 in wait_applied",
        "    mirror.py, line 90 in state",
        "[ps:0] Current thread 0x00007f02:",
        "    server.py, line 264 in join",
    ]
