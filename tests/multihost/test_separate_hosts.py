"""One cluster file, several machines: each host runs `towerflow launch --cluster ... --job_name ... --task_index ...`.

The hosts are network namespaces on a bridge (netns.py), each with its own address and with its
own hostname mapped to 127.0.0.1, as on a fresh Debian or Ubuntu machine; nothing else is set.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from _cluster_procs import wait_until  # tests/cluster, on the path from tests/conftest.py

REPO = Path(__file__).resolve().parent.parent.parent
MNIST = REPO.parent / "shared" / "data" / "mnist-t10k"
TOKEN = {"TOWERFLOW_CLUSTER_TOKEN": "multihost-test-token"}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _mnist():
    if not MNIST.is_dir():
        pytest.skip(f"needs the MNIST-t10k files at {MNIST}")
    return str(MNIST)


def _cluster_file(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    return path


def _accuracy(output: str) -> float:
    found = re.findall(r"test accuracy: ([0-9.]+)", output)
    assert found, f"no test accuracy in the output:\n{output[-3000:]}"
    return float(found[-1])


def test_allreduce_on_two_hosts_matches_one_host(hosts, tmp_path):
    import torch

    from _launch import launch  # tests/ps/_launch.py: the embedded cluster on this machine

    data = _mnist()
    h = hosts(2)
    cluster = _cluster_file(tmp_path, {"worker": [f"{h[0].name}:2222", f"{h[1].name}:2222"]})
    two_hosts = tmp_path / "two-hosts.pt"
    script = ["examples/mnist_sync.py", "--data", data, "--steps", "80", "--seed", "3"]
    procs = [h.launch(h[i], cluster, "worker", i, [*script, "--save", str(two_hosts)], TOKEN) for i in range(2)]
    for p in procs:
        assert p.wait(240) == 0, p.output[-4000:]
    assert _accuracy(procs[0].output) >= 0.9

    one_host = tmp_path / "one-host.pt"
    launch(["--workers", "2", *script, "--save", str(one_host)], timeout=240)
    a, b = torch.load(two_hosts), torch.load(one_host)
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= 1e-6, f"two hosts and one host trained different parameters (max difference {worst:g})"


@pytest.mark.parametrize("kind", ["parameter-server", "all-reduce"])
def test_a_lonely_task_names_the_missing_one_within_the_join_timeout(hosts, tmp_path, kind):
    h = hosts(2)
    spec = ({"ps": [f"{h[1].name}:2222"], "worker": [f"{h[0].name}:2222"]} if kind == "parameter-server"
            else {"worker": [f"{h[0].name}:2222", f"{h[1].name}:2222"]})
    missing = "/job:ps/task:0" if kind == "parameter-server" else "/job:worker/task:1"
    cluster = _cluster_file(tmp_path, spec)
    script = ["examples/mnist_ps.py" if kind == "parameter-server" else "examples/mnist_sync.py", "--steps", "5"]
    started = time.monotonic()
    lonely = h.launch(h[0], cluster, "worker", 0, script, {**TOKEN, "TOWERFLOW_JOIN_TIMEOUT": "5"})
    code = lonely.wait(60)
    took = time.monotonic() - started
    out = lonely.output
    assert code != 0
    assert took < 5 + 25, f"the lonely task took {took:.0f} s to give up (join timeout 5 s)"  # + the start, loaded
    assert f"{missing} at {h[1].name}:2222" in out, out[-3000:]
    assert "gave up after 5 s" in out


def test_a_task_with_the_wrong_token_is_refused(hosts, tmp_path):
    h = hosts(2)
    cluster = _cluster_file(tmp_path, {"worker": [f"{h[0].name}:2222"], "ps": [f"{h[1].name}:2222"]})
    script = ["examples/mnist_ps.py", "--steps", "5"]
    coordinator = h.launch(h[0], cluster, "worker", 0, script, {**TOKEN, "TOWERFLOW_JOIN_TIMEOUT": "5"})
    intruder = h.launch(h[1], cluster, "ps", 0, script, {"TOWERFLOW_CLUSTER_TOKEN": "not-the-token",
                                                         "TOWERFLOW_JOIN_TIMEOUT": "5"})
    assert intruder.wait(60) != 0
    assert "wrong cluster token" in intruder.output, intruder.output[-3000:]
    assert coordinator.wait(60) != 0  # and the coordinator never counted it
    assert "/job:ps/task:0" in coordinator.output


def test_an_address_no_interface_owns_fails_at_once(hosts, tmp_path):
    h = hosts(2)
    cluster = _cluster_file(tmp_path, {"worker": [f"{h[0].name}:2222", f"{h[1].name}:2222"]})
    wrong = h.launch(h[0], cluster, "worker", 1, ["examples/mnist_sync.py", "--steps", "5"], TOKEN)
    assert wrong.wait(30) == 2
    out = wrong.output
    assert f"/job:worker/task:1 is at '{h[1].name}:2222'" in out and h[0].address in out, out[-3000:]
    assert "Traceback" not in out


def test_the_ps_host_cut_off_mid_run_ends_the_job_with_a_clear_error(hosts, tmp_path):
    data = _mnist()
    h = hosts(3)
    cluster = _cluster_file(tmp_path, {"ps": [f"{h[0].name}:2222"], "worker": [f"{h[1].name}:2222", f"{h[2].name}:2222"]})
    env = {**TOKEN, "TOWERFLOW_HEARTBEAT_TIMEOUT": "4", "TOWERFLOW_JOIN_TIMEOUT": "10"}
    script = ["examples/mnist_ps.py", "--data", data, "--steps", "100000"]
    procs = [h.launch(h[0], cluster, "ps", 0, script, env),
             h.launch(h[1], cluster, "worker", 0, script, env),
             h.launch(h[2], cluster, "worker", 1, script, env)]
    wait_until(lambda: re.search(r"step \d+/", procs[1].output), 120, "worker 0 to report training steps")
    h[0].link(up=False)
    cut = time.monotonic()
    try:
        codes = [p.wait(60) for p in procs[1:]]
        took = time.monotonic() - cut
    finally:
        h[0].link(up=True)
    assert all(c != 0 for c in codes), codes
    assert took < 4 + 10, f"the workers took {took:.0f} s to give up on the cut-off ps (heartbeat timeout 4 s)"
    # each worker names the ps with its host's address: by the store's heartbeats or by a call's connection, its own
    # or the other worker's (whichever saw the cut first stops, and the other says why)
    for p in procs[1:]:
        assert (f"/job:ps/task:0 at {h[0].name}:2222 stopped answering" in p.output or
                re.search(rf"lost /job:ps/task:0 \(the connection from worker:\d to ps:0 at tcp://{re.escape(h[0].address)}:",
                          p.output)), p.output[-3000:]
    assert procs[0].wait(60) != 0  # the ps, alone on its side of the cut, does not hang either


def test_a_worker_host_that_loses_every_process_comes_back_and_the_job_finishes(hosts, tmp_path):
    """1 ps + 2 workers on three hosts, one task per host (the plain run across hosts, to 0.95), and the host of
    worker 1 loses its launcher and task mid-run: relaunched by its operator, it rejoins and the job finishes."""
    data = _mnist()
    h = hosts(3)
    cluster = _cluster_file(tmp_path, {"ps": [f"{h[0].name}:2222"], "worker": [f"{h[1].name}:2222", f"{h[2].name}:2222"]})
    script = ["examples/mnist_ps.py", "--data", data, "--steps", "350"]
    flags = ["--max-restarts", "1"]  # on every host: the others wait for a lost task to come back
    ps = h.launch(h[0], cluster, "ps", 0, script, TOKEN, flags)
    chief = h.launch(h[1], cluster, "worker", 0, script, TOKEN, flags)
    lost = h.launch(h[2], cluster, "worker", 1, script, TOKEN, flags)
    wait_until(lambda: re.search(r"step \d+/", chief.output), 120, "the chief to report training steps")
    lost.kill()  # the launcher and its task: the host lost every process
    back = h.launch(h[2], cluster, "worker", 1, script, TOKEN, flags)  # what its operator does next
    for p in (ps, chief, back):
        assert p.wait(240) == 0, p.output[-4000:]
    assert "rejoined the cluster (restart 1)" in back.output, back.output[-3000:]
    assert _accuracy(chief.output) >= 0.95


def test_ipv6_addresses_in_the_cluster_file(hosts, tmp_path):
    h = hosts(2)
    cluster = _cluster_file(tmp_path, {"ps": [f"[{h[0].address6}]:2222"], "worker": [f"[{h[1].address6}]:2222"]})
    script = ["examples/linear_regression_ps.py"]
    procs = [h.launch(h[0], cluster, "ps", 0, script, TOKEN), h.launch(h[1], cluster, "worker", 0, script, TOKEN)]
    for p in procs:
        assert p.wait(120) == 0, p.output[-3000:]
    w, b = map(float, re.search(r"final: w: ([-0-9.]+), b: ([-0-9.]+)", procs[1].output).groups())
    assert abs(w - 2.0) < 0.1 and abs(b - 0.2) < 0.1  # y = 2x + 0.2 + noise, learned through the ps


def test_an_allreduce_host_cut_off_mid_run_ends_the_job_with_a_clear_error(hosts, tmp_path):
    data = _mnist()
    h = hosts(2)
    cluster = _cluster_file(tmp_path, {"worker": [f"{h[0].name}:2222", f"{h[1].name}:2222"]})
    env = {**TOKEN, "TOWERFLOW_HEARTBEAT_TIMEOUT": "4"}
    script = ["examples/mnist_sync.py", "--data", data, "--steps", "100000"]
    procs = [h.launch(h[i], cluster, "worker", i, script, env) for i in range(2)]
    wait_until(lambda: re.search(r"train step \d+/", procs[0].output), 120, "worker 0 to report training steps")
    h[1].link(up=False)
    cut = time.monotonic()
    try:
        code = procs[0].wait(60)
        took = time.monotonic() - cut
        assert procs[1].wait(60) != 0  # the cut-off one, alone, does not hang either
    finally:
        h[1].link(up=True)
    assert code != 0
    assert took < 4 + 10, f"worker 0 took {took:.0f} s to give up on the cut-off replica (heartbeat timeout 4 s)"
    assert f"/job:worker/task:1 at {h[1].name}:2222 stopped answering" in procs[0].output, procs[0].output[-3000:]


def test_mirrored_ps_hosts_lost_for_good_one_after_the_other_leave_their_parts_to_the_next_and_the_job_finishes(
        hosts, tmp_path):
    """`--ps-replicas 2`, three ps tasks on three hosts: ps 0's host goes down mid-run and never comes back, so ps 1
    (another host) serves its part and feeds a mirror of it to ps 2 (the third host); then ps 1 is lost for good
    too, and ps 2 serves all three parts. Nothing acknowledged is lost, and every task left ends 0."""
    data = _mnist()
    h = hosts(3)  # ps 0 | ps 1 and the chief (the coordinator) | ps 2 and worker 1
    cluster = _cluster_file(tmp_path, {"ps": [f"{h[0].name}:2222", f"{h[1].name}:2223", f"{h[2].name}:2223"],
                                       "worker": [f"{h[1].name}:2222", f"{h[2].name}:2222"]})
    script = ["examples/mnist_ps.py", "--data", data, "--steps", "500"]
    flags = ["--ps-replicas", "2", "--max-restarts", "1"]
    ps = [h.launch(h[i], cluster, "ps", i, script, TOKEN, flags) for i in range(3)]
    chief = h.launch(h[1], cluster, "worker", 0, script, TOKEN, flags)
    worker = h.launch(h[2], cluster, "worker", 1, script, TOKEN, flags)
    wait_until(lambda: re.search(r"step [1-9]\d\d/", chief.output), 180, "the chief to pass step 100")
    ps[0].kill()  # its launcher and task: the host is gone for good
    wait_until(lambda: "its part is served by its backup" in chief.output, 60, "ps 0's part to be promoted")
    ps[1].kill()  # the task that took ps 0's part over, gone for good too
    for p in (ps[2], chief, worker):
        assert p.wait(240) == 0, p.output[-4000:]
    assert re.search(r"promoted its mirror of /job:ps/task:0's part of \S+ \(in place of ps:0\)", ps[1].output)
    assert re.search(r"promoted its mirror of /job:ps/task:0's part of \S+ \(in place of ps:1\)", ps[2].output)
    assert re.search(r"promoted its mirror of /job:ps/task:1's part of \S+ \(in place of ps:1\)", ps[2].output)
    for p in (chief, worker):
        assert re.search(r"/job:ps/task:0 and then ps:1, the backup that served its part, were lost: its part is served "
                         r"by its backup ps:2 \(promoted\).*lost: nothing", p.output), p.output[-3000:]
    assert _accuracy(chief.output) >= 0.95


def test_with_two_ps_tasks_on_each_host_a_ps_host_lost_for_good_loses_nothing(hosts, tmp_path):
    """`--ps-replicas 2`, ps 0 and 1 on one host, ps 2 and 3 on another: each part's mirror is on the other host (the
    ring takes the hosts in turn), so when the first host goes down for good with both its tasks, ps 2 and ps 3
    serve their parts from their mirrors; both workers lose nothing and every task left ends 0."""
    data = _mnist()
    h = hosts(3)  # ps 0 and ps 1 | ps 2, ps 3 and the chief | worker 1
    cluster = _cluster_file(tmp_path, {"ps": [f"{h[0].name}:2222", f"{h[0].name}:2223", f"{h[1].name}:2223",
                                              f"{h[1].name}:2224"],
                                       "worker": [f"{h[1].name}:2222", f"{h[2].name}:2222"]})
    script = ["examples/mnist_ps.py", "--data", data, "--steps", "500"]
    flags = ["--ps-replicas", "2", "--max-restarts", "1"]
    ps = [h.launch(h[i // 2], cluster, "ps", i, script, TOKEN, flags) for i in range(4)]
    chief = h.launch(h[1], cluster, "worker", 0, script, TOKEN, flags)
    worker = h.launch(h[2], cluster, "worker", 1, script, TOKEN, flags)
    wait_until(lambda: re.search(r"step [1-9]\d\d/", chief.output), 180, "the chief to pass step 100")
    for p in ps[:2]:
        p.kill()  # the host is gone for good: its launchers and tasks
    for p in (ps[2], ps[3], chief, worker):
        assert p.wait(240) == 0, p.output[-4000:]
    assert re.search(r"promoted its mirror of /job:ps/task:0's part of \S+ \(in place of ps:0\)", ps[2].output)
    assert re.search(r"promoted its mirror of /job:ps/task:1's part of \S+ \(in place of ps:1\)", ps[3].output)
    for p in (chief, worker):
        for task in (0, 1):
            assert re.search(rf"/job:ps/task:{task} .*its part is served by its backup ps:{task + 2} .*lost: nothing",
                             p.output), p.output[-3000:]
    assert _accuracy(chief.output) >= 0.95
