"""`towerflow launch` under a scheduler, without starting one: the recorded environments (golden.json) of
TFJob / PyTorchJob pods and Slurm slots become this slot's task, and a bad slot is refused with one line."""

from __future__ import annotations

import json
import pathlib
import socket
import sys
import threading

import pytest

from towerflow import taskenv
from towerflow.cli import main
from towerflow.cluster import addresses
from towerflow.cluster.store import c10d
from towerflow.cluster.membership import gather
from towerflow.cluster.environment import read_task
from towerflow.cluster.schedulers import Resolved, resolve
from towerflow.errors import ClusterTimeoutError
from towerflow.launch.local import PS_SERVE_MODULE
from towerflow.launch.scheduled import NOT_INHERITED, plan_scheduled, resolve_slot

GOLDEN = {c["name"]: c for c in json.loads(
    (pathlib.Path(__file__).parent.parent / "cluster" / "schedulers" / "golden.json").read_text())}
SCRIPT = [sys.executable, "train.py", "--steps", "5"]
POD_IP = "10.1.2.3"


def _env(name, **extra):
    return taskenv.scheduler_variables({**GOLDEN[name]["env"], **extra})


@pytest.fixture
def on_pod(monkeypatch):
    """This machine is the pod (or node) whose name a task's entry holds: every name resolves, POD_IP is ours."""
    def fake_resolve(host, where=""):
        return ["127.0.0.1"] if host in ("localhost", "127.0.0.1") else [POD_IP if host.startswith("me") else "10.9.9.9"]

    monkeypatch.setattr(addresses, "resolve", fake_resolve)
    monkeypatch.setattr(addresses, "local_addresses", lambda: {POD_IP: "eth0", "127.0.0.1": "lo"})
    for name in taskenv.SOCKET_IFNAME_VARIABLES:  # a Server an earlier test started here set them for itself
        monkeypatch.delenv(name, raising=False)
    return fake_resolve


def _plan(env, gpus=0, **kw):
    resolved = resolve_slot(env, **kw)
    assert resolved is not None
    return plan_scheduled(list(SCRIPT), resolved, gpus=lambda: gpus)


def _rename_own(env, old, new="me-pod"):
    """The slot's own host renamed 'me-...' (the fake resolver's name for this machine)."""
    return {k: v.replace(old, new) for k, v in env.items()}


def test_a_tfjob_worker_pod_runs_its_own_task(on_pod):
    env = _rename_own(_env("tfjob worker pod"), "mnist-worker-1.kubeflow.svc")
    plan = _plan(env)
    (task,) = plan.tasks
    tf = json.loads(task.env["TF_CONFIG"])
    assert (task.job, task.index, task.argv) == ("worker", 1, SCRIPT)
    assert tf["task"] == {"type": "worker", "index": 1} and tf["cluster"] == plan.cluster.as_dict()
    assert task.env["TOWERFLOW_JOB_NAME"] == "worker" and task.env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert task.env["RANK"] == "2" and "TOWERFLOW_DEVICE" not in task.env  # chief is rank 0; no GPU here
    assert task.env["MASTER_ADDR"] == "10.9.9.9" and task.env["MASTER_PORT"] == "12222"  # the chief's port + 10000
    assert set(NOT_INHERITED) <= set(task.unset)


def test_a_tfjob_ps_pod_serves_and_an_evaluator_reads_the_cluster(on_pod):
    ps = _plan(_rename_own(_env("tfjob ps pod"), "mnist-ps-1.kubeflow.svc")).tasks[0]
    assert ps.job == "ps" and ps.argv[1:3] == ["-m", PS_SERVE_MODULE] and "RANK" not in ps.env
    evaluator = _plan(_env("tfjob evaluator pod: not in the training cluster")).tasks[0]
    assert evaluator.job == "evaluator" and evaluator.argv == SCRIPT
    assert json.loads(evaluator.env["TF_CONFIG"])["task"] == {"type": "evaluator", "index": 0}
    assert "MASTER_ADDR" not in evaluator.env


def test_a_pytorchjob_pod_with_ps_roles(on_pod):
    env = _rename_own(_env("pytorchjob with roles ps=1"), "pytorch-dist", "me-dist")  # rank 0: the master pod
    (task,) = _plan(env).tasks
    assert task.job == "ps" and task.argv[1:3] == ["-m", PS_SERVE_MODULE]
    assert json.loads(task.env["TF_CONFIG"])["cluster"] == {
        "ps": ["me-dist-master-0:23457"], "worker": ["me-dist-worker-0:23457", "me-dist-worker-1:23457"]}
    assert "RANK" in task.unset and "TOWERFLOW_PS_TASKS" in task.unset  # not the pod's RANK=0


def test_the_device_hint_is_given_only_when_the_gpu_exists(on_pod):
    env = _rename_own(_env("slurm names with dashes and digits, 8 GPUs per node"), "dgx-a100", "me-dgx")
    resolved = resolve_slot(env)
    assert resolved.device == f"gpu:{resolved.local_rank}"
    with_gpu = plan_scheduled(list(SCRIPT), resolved, gpus=lambda: resolved.local_rank + 1).tasks[0]
    assert with_gpu.env["TOWERFLOW_DEVICE"] == f"/device:GPU:{resolved.local_rank}"
    without = plan_scheduled(list(SCRIPT), resolved, gpus=lambda: resolved.local_rank).tasks[0]
    assert "TOWERFLOW_DEVICE" not in without.env


def test_tf_config_and_none_are_not_a_scheduler_for_the_launcher():
    assert resolve_slot(_env("towerflow launch's task under srun: TF_CONFIG wins")) is None
    assert resolve_slot(_env("plain TF_CONFIG by hand")) is None
    assert resolve_slot(_env("slurm single task on one node"), scheduler="none") is None
    assert resolve_slot(_env("slurm single task on one node", TOWERFLOW_SCHEDULER="none")) is None
    assert resolve_slot(_env("slurm single task on one node")).scheduler == "slurm"


def test_read_task_falls_back_to_the_scheduler():
    env = _env("slurm roles ps=1 of 4: rank 1 is worker:0")
    info = read_task([], env=env)
    assert (info.job_name, info.task_index, info.source) == ("worker", 0, "slurm")
    assert info.cluster.as_dict() == resolve(env).cluster_spec().as_dict()
    torchrun = read_task([], env=_env("torchrun one node, 4 processes"))
    assert torchrun.source == "torchrun" and torchrun.cluster.num_tasks("worker") == 4


def _slurm_shell(monkeypatch, name, **extra):
    for k in list(taskenv.scheduler_variables(dict(__import__("os").environ))):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**GOLDEN[name]["env"], **extra}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("name, flags, said", [
    ("slurm roles ps=1 of 4: rank 1 is worker:0", ["--workers", "2"], "--workers: under slurm the scheduler starts"),
    ("slurm roles ps=1 of 4: rank 1 is worker:0", ["--nproc", "2"], "drop --nproc"),
    ("slurm cyclic distribution refused", [], "SLURM_DISTRIBUTION='cyclic'"),
    ("slurm single task on one node", ["--ps", "1"], "need 2 ranks or more"),
    ("slurm bad SLURM_PROCID", [], "SLURM_PROCID"),
    ("TOWERFLOW_SCHEDULER misspelt", [], "unknown scheduler 'slrum'"),
])
def test_a_bad_slot_is_refused_with_one_line(monkeypatch, capsys, tmp_path, name, flags, said):
    _slurm_shell(monkeypatch, name)
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    assert main(["launch", *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and err.startswith("towerflow launch: "), err


def _slot(rank, world, port, rendezvous):
    return Resolved("mpi", "ps" if rank == 0 else "worker", max(rank - 1, 0), {"ps": 1, "worker": world - 1}, None,
                    {}, rank, world, rank, world, None, port, rendezvous)


def test_addresses_are_gathered_at_the_rendezvous(free_ports):
    rdv = f"127.0.0.1:{free_ports(1)[0]}"
    out, threads = {}, []
    for rank in range(3):
        t = threading.Thread(target=lambda r=rank: out.__setitem__(r, gather.complete(_slot(r, 3, 31000 + r, rdv), 20)))
        threads.append(t)
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(out) == [0, 1, 2]
    clusters = {json.dumps(r.cluster, sort_keys=True) for r in out.values()}
    assert clusters == {json.dumps({"ps": ["127.0.0.1:31000"], "worker": ["127.0.0.1:31001", "127.0.0.1:31002"]},
                                   sort_keys=True)}


def test_a_rank_without_a_port_gets_one_that_stays_its_own(free_ports):
    """The others learn the port at the rendezvous; the task binds it later: meanwhile nothing else may take it."""
    got = gather.complete(_slot(0, 1, None, f"127.0.0.1:{free_ports(1)[0]}"), 20)
    port = got.port
    assert got.cluster["ps"][0].endswith(f":{port}"), got.cluster
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # another program asking for this port is refused
    c10d.listen("127.0.0.1", port).close()  # the task itself can listen on it


def test_a_rank_that_never_comes_is_named(free_ports):
    rdv = f"127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(ClusterTimeoutError, match=r"1 of 3 ranks; missing: rank 1, 2"):
        gather.complete(_slot(0, 3, 31000, rdv), 1.0)


def test_strategy_from_env_places_a_plain_srun_task(monkeypatch):
    """`TOWERFLOW_PS_TASKS=1 srun -n 3 python SCRIPT`, rank 1: the strategy is handed the context the launcher
    would have given worker:0, and the process's own environment stays as the scheduler set it (the strategy
    itself is forced to one_device: nothing starts here)."""
    import os

    from towerflow.strategies.environment import strategy_from_env

    host = socket.gethostname().split(".")[0]
    env = {k: v for k, v in os.environ.items() if k not in taskenv.scheduler_variables(os.environ)}
    env.update({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3",
                "SLURM_STEP_NODELIST": host, "SLURM_STEP_TASKS_PER_NODE": "3", "SLURM_LOCALID": "1",
                "TOWERFLOW_PS_TASKS": "1"})
    before = dict(env)
    monkeypatch.setattr(os, "environ", env)
    task = strategy_from_env("one_device").context
    assert (task.identity.job_name, task.identity.task_index, task.identity.rank, task.identity.world_size) == ("worker", 0, 0, 2)
    assert len(task.identity.cluster["ps"]) == 1 and len(task.identity.cluster["worker"]) == 2
    assert "TOWERFLOW_PS_TASKS" not in task.scheduler_env  # the roles were applied: not asked again downstream
    assert env == before
