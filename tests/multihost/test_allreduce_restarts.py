"""All-reduce replicas on separate hosts, one `towerflow launch --cluster ...` per host: a replica lost on one
host makes every launcher restart its own replica (the process group cannot take a member back), and a whole
host lost, relaunched by its operator, does the same; each time the group resumes from the newest checkpoint
in the shared logdir, and the run ends with exactly the parameters of an uninterrupted run on one host.

The hosts are network namespaces (netns.py); the replicas run tests/launch/_ft_allreduce.py, whose batches are
a function of (global step, rank), so a resumed run sees the batches an uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _cluster_procs import wait_until  # tests/cluster, on the path from tests/conftest.py

REPO = Path(__file__).resolve().parent.parent.parent
TRAIN = str(REPO / "tests" / "launch" / "_ft_allreduce.py")
TOKEN = {"TOWERFLOW_CLUSTER_TOKEN": "multihost-allreduce-token"}
STEPS = "120"  # 20 ms a step: the second loss lands near step 25, long before the end

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _final(output: str) -> str:
    found = re.findall(r"final: (sha256 [0-9a-f]+)", output)
    assert found, output[-3000:]
    return found[-1]


def _uninterrupted(folder: Path) -> str:
    """The final parameters' hash of the same job run on this machine alone, `towerflow launch --workers 2`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERFLOW_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "towerflow", "launch", "--workers", "2", TRAIN, str(folder), STEPS],
                          env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return _final(done.stdout)


def _pid_in(path: Path) -> int:
    return int(path.read_text().split()[0])


def test_a_replica_then_the_chief_host_lost_restart_the_group_across_hosts_exactly(hosts, tmp_path):
    straight = _uninterrupted(tmp_path / "straight")
    h = hosts(2)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"worker": [f"{h[0].name}:2222", f"{h[1].name}:2222"]}))
    folder = tmp_path / "run"
    folder.mkdir()
    script = [TRAIN, str(folder), STEPS]
    flags = ["--max-restarts", "2"]
    chief = h.launch(h[0], cluster, "worker", 0, script, TOKEN, flags)
    other = h.launch(h[1], cluster, "worker", 1, script, TOKEN, flags)

    first = folder / "1.0.pid"  # replica 1 after 15 steps of its own, past the step-10 checkpoint
    wait_until(lambda: first.exists() or chief.popen.poll() is not None, 120, "replica 1's first 15 steps")
    os.kill(_pid_in(first), signal.SIGKILL)

    second = folder / "0.1.pid"  # the chief's restarted replica, 15 steps after the group resumed
    wait_until(lambda: second.exists() or chief.popen.poll() is not None, 120, "the group to resume")
    assert second.exists(), chief.output[-3000:]
    chief.kill()  # its host: the launcher and its replica
    chief = h.launch(h[0], cluster, "worker", 0, script, TOKEN, flags)  # what its operator does next

    for p in (chief, other):
        assert p.wait(180) == 0, p.output[-4000:]
    assert re.search(r"/job:worker/task:1 \(pid \d+\) was killed by signal 9; restarting it \(1 of 2\)", other.output), \
        other.output[-3000:]
    # once after each loss (its first incarnation may find the chief's checkpoint of step 0 and say so too)
    resumed = [int(s) for s in re.findall(r"rank 1 \(restart [1-9]\) resumed at step (\d+)", other.output)]
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1], other.output[-3000:]
    assert re.search(rf"rank 0 \(restart 0\) resumed at step {resumed[1]}\b", chief.output), chief.output[-3000:]
    assert _final(chief.output) == straight  # bit for bit: the same batches and updates after each restore
