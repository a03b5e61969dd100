"""`towerflow launch`: roles and environment, prefixed output, failures stop everything, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from _cluster_procs import wait_until

from _cluster_procs import alive


pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

TASK = str(Path(__file__).parent / "_launch_task.py")
ROOT = Path(__file__).parent.parent.parent


def pids(folder: Path):
    """The tasks' pids as far as written (a task may be in the middle of writing its file)."""
    found = {p.stem: p.read_text().strip() for p in folder.glob("*.pid")}
    return {task: int(pid) for task, pid in found.items() if pid}


def test_each_task_gets_its_role_and_the_environment_contract(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--chief", "--workers", "2", "--ps", "1", "--ps-runs-script", "--logdir", str(tmp_path / "logs"), TASK, "env", str(tmp_path))
    assert run.wait(60) == 0, run.describe()
    envs = {}
    for line in run.out.splitlines():
        m = re.match(r"\[(\w+:\d)\] (\{.*\})$", line)
        if m:
            envs[m.group(1)] = json.loads(m.group(2))
    assert sorted(envs) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    assert "[worker:1] to stderr" in run.err  # stderr is prefixed too
    ranks = {k: (v["RANK"], v["LOCAL_RANK"], v["LOCAL_WORLD_SIZE"], v["WORLD_SIZE"]) for k, v in envs.items()}
    assert ranks == {"chief:0": ("0", "0", "3", "3"), "worker:0": ("1", "1", "3", "3"), "worker:1": ("2", "2", "3", "3"), "ps:0": (None, None, None, "3")}
    for name, env in envs.items():
        job, index = name.split(":")
        tf = json.loads(env["TF_CONFIG"])
        assert (env["TOWERFLOW_JOB_NAME"], env["TOWERFLOW_TASK_INDEX"], tf["task"]) == (job, index, {"type": job, "index": int(index)})
        assert all(a.startswith("127.0.0.1:") for hosts in tf["cluster"].values() for a in hosts)  # loopback only
        assert env["TOWERFLOW_LOGDIR"] == str(tmp_path / "logs") and env["MASTER_ADDR"] == "127.0.0.1"
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1 and len({e["TOWERFLOW_CLUSTER_TOKEN"] for e in envs.values()}) == 1
    launches = {e["TOWERFLOW_LAUNCH_ID"] for e in envs.values()}
    assert len(launches) == 1 and None not in launches  # one launcher, one id for every task it starts


def test_nproc_and_devices_start_one_worker_per_device(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--devices", "cpu:0,gpu:1", TASK, "env", str(tmp_path))
    assert run.wait(60) == 0, run.describe()
    devices = sorted(json.loads(l.split("] ", 1)[1])["TOWERFLOW_DEVICE"] for l in run.out.splitlines() if l.startswith("[worker"))
    assert devices == ["/device:CPU:0", "/device:GPU:1"]
    bad = launcher.python("-m", "towerflow", "launch", "--devices", "tpx:0", TASK, "env", str(tmp_path))
    assert bad.wait(30) == 2 and "unknown device type 'tpx'" in bad.err


def test_a_crashing_task_stops_the_others_and_sets_the_exit_code(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--ps-runs-script", TASK, "crash", str(tmp_path))
    assert run.wait(60) == 3, run.describe()
    assert "/job:worker/task:1" in run.err and "failed first: it exited with code 3" in run.err
    assert "worker 1 is about to fail" in run.err and "stopped the other 2 running task(s)" in run.err
    assert "Last lines of its stderr" not in run.err and run.err.count("worker 1 is about to fail") == 1  # said once
    started = pids(tmp_path)
    assert sorted(started) == ["ps:0", "worker:0", "worker:1"]
    assert not [name for name, pid in started.items() if alive(pid)], "tasks left running after the launch ended"


def test_ctrl_c_stops_every_task(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--workers", "2", TASK, "sleep", str(tmp_path))
    wait_until(lambda: len(pids(tmp_path)) == 2, 30, "both tasks to start")
    os.kill(run.popen.pid, signal.SIGINT)
    assert run.wait(30) == 130, run.describe()
    assert not [pid for pid in pids(tmp_path).values() if alive(pid)]


def test_max_restarts_restarts_a_failed_task(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--workers", "1", "--max-restarts", "1", TASK, "flaky", str(tmp_path))
    assert run.wait(60) == 0, run.describe()
    assert re.search(r"/job:worker/task:0 \(pid \d+\) exited with code 5; restarting it \(1 of 1\)", run.err), run.err
    launches = re.findall(r"\[worker:0\] launch (\S+)", run.out)  # a restart finds its run by it (cluster/membership/ending.py)
    assert len(launches) == 2 and launches[0] == launches[1] != "None", run.out


def test_bad_flags_are_refused(launcher, tmp_path):
    runs = [  # started together: each launcher pays the torch import
        launcher.python("-m", "towerflow", "launch", "--cluster", str(tmp_path / "none.json"), TASK, "env", str(tmp_path)),
        launcher.python("-m", "towerflow", "launch", "--nproc", "2", "--workers", "3", TASK, "env", str(tmp_path)),
    ]
    assert [r.wait(30) for r in runs] == [2, 2], launcher.describe()
    assert "--cluster needs --job_name and --task_index" in runs[0].err
    assert "--workers 3 disagrees with 2 device(s)" in runs[1].err


def test_ps_mode_flags_reach_every_task_and_bad_combinations_are_refused(launcher, tmp_path):
    runs = [
        launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--ps-runs-script", "--mode", "sync", "--replicas-to-aggregate", "1", TASK, "env", str(tmp_path)),
        launcher.python("-m", "towerflow", "launch", "--workers", "2", "--mode", "ssp", TASK, "env", str(tmp_path)),
        launcher.python("-m", "towerflow", "launch", "--ps", "1", "--mode", "async", "--staleness", "2", TASK, "env", str(tmp_path)),
    ]
    assert [r.wait(60) for r in runs] == [0, 2, 2], launcher.describe()
    envs = [json.loads(l.split("] ", 1)[1]) for l in runs[0].out.splitlines() if re.match(r"\[\w+:\d\] \{", l)]
    assert len(envs) == 3
    assert {(e["TOWERFLOW_PS_MODE"], e["TOWERFLOW_PS_REPLICAS_TO_AGGREGATE"]) for e in envs} == {("sync", "1")}
    assert "--mode ssp chooses how parameter servers apply updates; add --ps N" in runs[1].err
    assert "--staleness 2 goes with --mode ssp (got --mode async)" in runs[2].err


def test_pi_distributed_under_launch(launcher):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", str(ROOT / "examples" / "pi_distributed.py"), "--samples", "2000000")
    assert run.wait(80) == 0, run.describe()
    m = re.search(r"\[worker:0\] pi ~= ([\d.]+)", run.out)
    assert m and abs(float(m.group(1)) - 3.14159) < 0.01, run.out
    assert re.search(r"3 tasks drew 2,000,000 samples in [\d.]+ s \([\d,]+ samples/s\)", run.out)


def test_hello_cluster_as_one_task_per_host_and_by_hand_with_the_seed_flags(launcher, tmp_path, free_ports):
    ports = free_ports(2)
    hosts = [f"localhost:{p}" for p in ports]
    (tmp_path / "cluster.json").write_text(json.dumps({"worker": hosts}))
    hello = str(ROOT / "examples" / "hello_cluster.py")
    by_hand = launcher.python(hello, "--worker_hosts", ",".join(hosts), "--job_name", "worker", "--task_index", "1", label="by_hand")
    launched = launcher.python("-m", "towerflow", "launch", "--cluster", str(tmp_path / "cluster.json"), "--job_name", "worker", "--task-index", "0", hello, label="launched")
    assert [launched.wait(80), by_hand.wait(30)] == [0, 0], launcher.describe()
    assert "[worker:0] Hello, this is /job:worker/task:0" in launched.out
    assert "[worker:0] Hello, this is /job:worker/task:1" in launched.out


@pytest.mark.gpu
def test_pi_multi_device_on_a_gpu_worker(launcher):
    run = launcher.python("-m", "towerflow", "launch", "--devices", "gpu:0", str(ROOT / "examples" / "pi_multi_device.py"), "--samples", "2000000")
    assert run.wait(80) == 0, run.describe()
    m = re.search(r"pi ~= ([\d.]+)", run.out)
    assert m and abs(float(m.group(1)) - 3.14159) < 0.01, run.out


def test_a_ps_task_runs_functions_from_a_module_beside_the_script(launcher, tmp_path):
    # The ps does not run the script (it serves), but it imports as the script would: a function
    # of a module next to the script travels by reference and must resolve there.
    (tmp_path / "helpers_beside.py").write_text(
        "import os\n\ndef where(x):\n    return f\"{os.environ['TOWERFLOW_JOB_NAME']} doubled {x} to {2 * x}\"\n"
    )
    script = tmp_path / "train.py"
    script.write_text(
        "import towerflow\nimport helpers_beside\n\n"
        "server = towerflow.Server()\n"
        "print(towerflow.remote(helpers_beside.where, 21, device='/job:ps/task:0').result(), flush=True)\n"
        "server.join()\n"
    )
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "1", str(script))
    assert run.wait(60) == 0, run.describe()
    assert "[worker:0] ps doubled 21 to 42" in run.out, run.out
