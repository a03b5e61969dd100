"""The first failure is the one reported, once. A task of a ps job raises at a random
step, one run for each kind of task, at a moment drawn from two of early, middle and late in the run (every
moment is drawn for two kinds): the launcher names it every time, its traceback appears
exactly once, every other task says in at most one line that it stopped because of it, and the
transport's closed-connection warnings are left out. Then the same for all-reduce replicas (a
gloo process group, no Server), the all-reduce case of a wrong --data, and one launcher per task
(`--cluster`): each names the remote task that failed first.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from _cluster_procs import alive  # tests/cluster, on the path from tests/conftest.py

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

HERE = Path(__file__).parent
TASK = str(HERE / "_verdict_task.py")
ROOT = HERE.parent.parent
LABELS = ("chief:0", "worker:0", "ps:0")
EARLY, MIDDLE, LATE = (3, 6), (7, 11), (12, 15)  # the step ranges a task raises in
# two moments per kind of task, each moment for two of the three kinds; one run per kind draws one of its two
# (a run costs ~12 s on 2 cores: two runs per kind cost the suite ~35 s more)
MOMENTS = {"chief:0": (EARLY, LATE), "worker:0": (EARLY, MIDDLE), "ps:0": (MIDDLE, LATE)}


def check_once(err: str, where: str) -> None:
    assert err.count("Traceback (most recent call last)") == 1, where
    assert err.count('raise RuntimeError(f"injected failure in {me} at step {step}")') == 1, where
    assert "Last lines of its stderr" not in err and "recvValue failed" not in err, where


def run_and_check(launcher, folder: Path, cluster, labels, label: str, moment=(3, 15)) -> None:
    """One launch in which task `label` raises at a random step within `moment`, and every check on its output."""
    job, index = label.split(":")
    name = f"/job:{job}/task:{index}"
    step = random.randint(*moment)
    folder.mkdir()
    p = launcher.python("-m", "towerflow", "launch", *cluster, TASK, label, str(step), str(folder),
                        label=f"{folder.name}-{job}{index}")
    where = f"{label} raising at step {step}:\n{p.describe()}"
    assert p.wait(90) == 1, where
    err = p.err
    assert re.search(rf"^towerflow launch: {re.escape(name)} \(pid \d+ on \S+\) failed first \(", err, re.M), where
    assert re.search(rf"RuntimeError: injected failure in {label} at step \d+$", err, re.M), where
    check_once(err, where)
    for other in labels:
        if other == label:
            continue
        other_name = f"/job:{other.replace(':', '/task:')}"
        said = [line for line in err.splitlines() if line.startswith(f"[{other}] ") and ": waiting for " not in line]
        assert len(said) <= 1 and all(name in line for line in said), where  # one line, naming the cause
        assert re.search(rf"^towerflow launch: ({re.escape(other_name)} stopped because of it|stopped the other .*"
                         rf"{re.escape(other_name)})", err, re.M), where
    pids = {f.stem: int(f.read_text()) for f in folder.glob("*.pid")}
    assert sorted(pids) == sorted(labels) and not [t for t, pid in pids.items() if alive(pid)], where


@pytest.mark.parametrize("label", LABELS)
def test_the_task_that_raised_is_named_every_time_and_its_traceback_shown_once(launcher, tmp_path, label):
    moment = random.choice(MOMENTS[label])
    run_and_check(launcher, tmp_path / "run", ("--chief", "--ps", "1", "--workers", "1", "--ps-runs-script"), LABELS, label,
                  moment)


def test_an_all_reduce_replica_that_raised_is_named_and_its_peer_s_gloo_error_is_a_consequence(launcher, tmp_path):
    replicas = ("worker:0", "worker:1")
    for label in replicas:
        run_and_check(launcher, tmp_path / label.replace(":", ""), ("--workers", "2"), replicas, label)


def test_a_wrong_data_folder_under_all_reduce_is_reported_once(launcher):
    p = launcher.python("-m", "towerflow", "launch", "--workers", "2", str(ROOT / "examples" / "mnist_sync.py"),
                        "--data", "/nonexistent")
    assert p.wait(90) == 1, p.describe()
    err = p.err
    m = re.search(r"^towerflow launch: /job:worker/task:(\d) \(pid \d+ on \S+\) failed first \(exit code 1\):$", err, re.M)
    assert m, p.describe()
    other = 1 - int(m.group(1))
    assert err.count("Traceback (most recent call last)") == 1, p.describe()
    # the other task meets the same error unless the launcher stopped it first (still starting, on a loaded machine)
    also = rf"^towerflow launch: /job:worker/task:{other} also failed on its own \([^)]*\): the same error$"
    stopped = rf"^towerflow launch: stopped the other 1 running task\(s\): /job:worker/task:{other}\.$"
    if re.search(also, err, re.M):
        assert err.count("DataError: --data '/nonexistent' is not a folder") == 3, p.describe()  # both tasks + verdict
    else:
        assert re.search(stopped, err, re.M), p.describe()
        assert err.count("DataError: --data '/nonexistent' is not a folder") == 2, p.describe()  # its line + verdict
    assert "Last lines of its stderr" not in err


def test_one_task_per_host_launchers_each_name_the_remote_task_that_failed_first(launcher, tmp_path, free_ports):

    ports = free_ports(3)
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"chief": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"], "ps": [f"localhost:{ports[2]}"]}))
    step = random.randint(3, 15)
    runs = {label: launcher.python("-m", "towerflow", "launch", "--cluster", str(tmp_path / "cluster.json"),
                                   "--job_name", label.split(":")[0], "--task_index", "0", "--ps-runs-script", TASK, "worker:0", str(step),
                                   str(tmp_path), label=label.replace(":", ""))
            for label in LABELS}
    assert [runs[label].wait(90) for label in LABELS] == [1, 1, 1], launcher.describe()
    for label, p in runs.items():
        err = p.err
        head = re.search(r"^towerflow launch: /job:worker/task:0 \(pid \d+ on \S+\) failed first(.*)$", err, re.M)
        assert head, launcher.describe()
        if label == "worker:0":  # its own launcher prints the traceback
            check_once(err, launcher.describe())
        else:  # the others name it from the record their task read in the cluster's store
            assert head.group(1).startswith(": RuntimeError: injected failure in worker:0 at step"), launcher.describe()
            assert "Traceback" not in err and "recvValue failed" not in err, launcher.describe()
            assert f"towerflow launch: /job:{label.replace(':', '/task:')} stopped because of it" in err, launcher.describe()


NOISE = ("[W1123 16:00:17.671993333 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=5, addr=[::ffff:"
         "127.0.0.1]:46880, remote=[::ffff:127.0.0.1]:33169): Connection reset by peer")


def _supervise(tasks):
    import io
    import sys

    from towerflow.launch.supervisor import Supervisor
    from towerflow.launch.task_process import TaskProcessSpec

    out, err = io.StringIO(), io.StringIO()
    specs = [TaskProcessSpec("worker", i, [sys.executable, "-c", code], {}) for i, code in enumerate(tasks)]
    return Supervisor(specs, out=out, err=err).run(), err.getvalue()


STORE_NOISE = ["[W1123 16:00:17.671993333 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=5): Connection "
               "reset by peer", "Exception raised from recvBytes at /x/Utils.hpp:784 (most recent call first):",
               "frame #0: c10::Error::Error() + 0x9d (0x7f in libc10.so)", "<omitting python frames>", ""]


def test_a_store_warning_and_its_cpp_stack_are_left_out_of_a_failing_run_together():
    warn = f"import sys; print({chr(10).join(STORE_NOISE)!r}, file=sys.stderr, flush=True); print('mine', file=sys.stderr)"
    code, err = _supervise([warn + "; import time; time.sleep(30)", "import time, sys; time.sleep(0.5); sys.exit(3)"])
    assert code == 3 and "c10d" not in err and "frame #0" not in err and "[worker:0] mine" in err, err
    code, err = _supervise([warn])  # nothing failed: printed whole, in its order (after the hold, so after "mine")
    assert code == 0 and "\n".join(f"[worker:0] {line}" for line in STORE_NOISE) in err and "[worker:0] mine" in err, err


def test_a_task_that_reported_its_own_failure_exits_with_its_own_code_not_as_stopped():
    # worker:1 fails first (its report written) but takes a moment to exit; worker:0 fails after it and exits at once.
    slow = ("import json, os, sys, time; open(os.environ['TOWERFLOW_ERROR_FILE'], 'w').write('{}'); "
            "time.sleep(1.0); sys.exit(4)")
    code, err = _supervise(["import time, sys; time.sleep(0.3); sys.exit(3)", slow])
    assert "stopped by the launcher" not in err and "stopped it" not in err, err
    assert "exit code 4" in err, err


def test_transport_warnings_are_printed_in_a_healthy_run_and_left_out_of_a_failing_one():
    warn = f"import sys; print({NOISE!r}, file=sys.stderr, flush=True)"
    code, err = _supervise([warn])  # nothing failed: printed (after the hold)
    assert code == 0 and f"[worker:0] {NOISE}" in err, err
    code, err = _supervise([warn + "; import time; time.sleep(30)", "import time, sys; time.sleep(0.5); sys.exit(3)"])
    assert code == 3 and "recvValue failed" not in err, err
    assert "towerflow launch: left out 1 transport warning(s)" in err, err
