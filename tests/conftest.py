"""Shared fixtures: every test starts from default options and must not leak placement state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import towerflow
from towerflow.devices import logical
from towerflow.placement import mode, scope


def _reset() -> None:
    logical._in_use = False
    logical._local = None
    towerflow.configure(towerflow.Config())
    towerflow.placement_log(clear=True)


@pytest.fixture(autouse=True)
def clean_placement_state():
    _reset()
    yield
    leaked_frames = list(scope.state.frames)
    scope.state.frames.clear()
    _reset()
    assert not leaked_frames, f"a test left device scopes open: {leaked_frames}"
    assert not mode._thread.installed, "the placement mode is still installed with no scope and the log off"


def pytest_collection_modifyitems(config, items):
    _group_the_host_tests(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_only(monkeypatch):
    """This process finds only the CPU, as on a machine without a GPU: for tests of CPU behaviour (logical CPU
    devices, their towers, partial specs that fall back to the CPU) that the suite also runs on GPU machines."""
    from towerflow.devices import physical
    monkeypatch.setattr(physical, "discover", lambda: [physical.cpu_device()])
    monkeypatch.setattr(physical, "gpu_count", lambda: 0)
    logical._table = None
    yield
    logical._table = None


@pytest.fixture
def free_ports():
    """n free loopback ports, held (cluster/ports.py) until the test ends: the test's processes can bind them,
    another test's cluster or an outgoing connection cannot take them in between."""
    from towerflow.cluster.ports import PortReservation

    held = []

    def reserve(n: int):
        held.append(PortReservation(n))
        return list(held[-1].ports)

    yield reserve
    for reservation in held:
        reservation.release()


# --- processes started by multi-process tests (tests/cluster/_cluster_procs.py) -------------

sys.path.insert(0, str(Path(__file__).parent / "cluster"))


@pytest.fixture
def procs(tmp_path, request):
    """Start processes; on teardown kill their process groups, and show their output if the test failed."""
    from _cluster_procs import Procs

    started = Procs(tmp_path)
    yield started
    for p in started.started:
        p.kill_group()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(started.describe())  # shown by pytest under "Captured stdout teardown"


@pytest.fixture
def launcher(procs):
    """`procs`, named for tests that start `towerflow launch`."""
    return procs


@pytest.fixture
def redis_url(tmp_path):
    """A redis-server of its own on a free loopback port, in memory only; stopped after the test."""
    import shutil
    import socket
    import subprocess

    from _cluster_procs import wait_until

    redis = pytest.importorskip("redis")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (tools/install_schedulers.sh installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True)
    client = redis.Redis(host="127.0.0.1", port=port)

    def up():
        try:
            return client.ping()
        except redis.ConnectionError:
            return server.poll() is not None

    try:
        wait_until(up, 20, "redis-server to answer")
        assert server.poll() is None, "redis-server exited at start"
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.kill()
        server.wait(10)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup). The tests that start
# the namespace hosts or the real schedulers (one Slurm, one set of hosts per machine) share one
# group, so one worker runs them one after another; everything else goes to whichever worker is free.
_HOSTS_GROUP_DIRS = ("schedulers", "multihost")


def _group_the_host_tests(items) -> None:
    for item in items:
        if Path(str(item.fspath)).parent.name in _HOSTS_GROUP_DIRS:
            item.add_marker(pytest.mark.xdist_group("hosts"))


@pytest.fixture
def launch_script(tmp_path, monkeypatch):
    """A trivial training script to plan a launch of, with every scheduler's variables cleared, so the plan is the
    embedded cluster's (or the one the test sets up)."""
    for name in ("SLURM_JOB_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", "WORLD_SIZE",
                 "TF_CONFIG", "TOWERFLOW_SCHEDULER", "PET_NNODES", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)
