"""`towerflow launch` (and a plain `python` with strategy_from_env) as the tasks of a real Slurm job step:
each srun task runs its own slot's task of one cluster (docs/cluster.md, "Slurm")."""

from __future__ import annotations

import os
import time

import pytest

from _slots import CLUSTER, DATA, LAUNCH, MNIST_PS, MNIST_SYNC, SLOT_TASK, accuracy, cluster_jsons, slots, task_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def srun(slurm, argv, timeout, **extra):
    """srun with a hard deadline; at it, the job is cancelled (its tasks with it) before the test fails."""
    t0 = time.monotonic()
    try:
        done = slurm.run(["srun", "--overcommit", "--kill-on-bad-exit=1", *argv], timeout=timeout, env=task_env(**extra))
    except AssertionError:
        slurm.run(["scancel", "--full", "--quiet", "--user", "root"], timeout=20, check=False)
        raise
    print(f"srun {' '.join(argv[:6])} ...: {time.monotonic() - t0:.1f} s")
    print("\n".join(line for line in done.stdout.splitlines() if "SLOT {" in line or "SHUTDOWN" in line))
    return done


def test_cluster_json_under_srun(slurm, tmp_path):
    # One output file per task: srun forwards its tasks' output in pieces of 1 KiB, which split a long line.
    srun(slurm, ["-n", "3", f"--output={tmp_path}/rank-%t.out", *CLUSTER, "--json", "--ps", "1"], timeout=60)
    ranks = cluster_jsons("\n".join(p.read_text() for p in sorted(tmp_path.glob("rank-*.out"))))
    assert [r["task"] for r in ranks] == [{"type": "ps", "index": 0}, {"type": "worker", "index": 0},
                                          {"type": "worker", "index": 1}], ranks
    assert len({str(r["cluster"]) for r in ranks}) == 1 and {r["scheduler"] for r in ranks} == {"slurm"}
    assert ranks[1]["cluster"]["worker"][0] == ranks[1]["address"]


@pytest.mark.skipif(not os.path.isdir(DATA), reason=f"MNIST-t10k not found at {DATA}")
def test_srun_launch_ps_mnist_reaches_095(slurm):
    done = srun(slurm, ["-n", "3", *LAUNCH, "--ps", "1", MNIST_PS, "--data", DATA, "--mode", "sync", "--steps", "200"],
                timeout=240)
    text = done.stdout + done.stderr
    print(f"test accuracy after 200 sync steps: {accuracy(text)}")
    assert accuracy(text) >= 0.95, text[-4000:]
    assert "200 updates, 0 stale dropped" in text  # one ps, two workers in one sync cluster, not three clusters
    assert "ParameterServerStrategy(worker 0 of 2, 1 ps, sync" in text  # ps:0 serves quietly (rank 0)


def test_srun_launch_all_reduce(slurm):
    done = srun(slurm, ["-n", "2", *LAUNCH, MNIST_SYNC, "--steps", "20", "--batch-size", "32"], timeout=120)
    text = done.stdout + done.stderr
    assert "MultiWorkerMirroredStrategy(replica 0 of 2" in text, text[-4000:]
    assert "test accuracy" in text and "no cluster token" not in text  # one node: no warning


def test_srun_plain_python_with_ps_tasks(slurm):
    done = srun(slurm, ["-n", "3", os.sys.executable, SLOT_TASK, "5"], timeout=120, TOWERFLOW_PS_TASKS="1")
    found = slots(done.stdout)
    assert [(s["job"], s["index"]) for s in found] == [("worker", 0), ("worker", 1)], done.stdout + done.stderr
    assert {s["strategy"] for s in found} == {"parameter_server"}
    assert len({str(s["cluster"]) for s in found}) == 1 and len(found[0]["cluster"]["ps"]) == 1
    assert found[0]["global_step"] == 10  # both workers' pushes reached the ps that rank 0 served
