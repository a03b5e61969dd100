"""`towerflow cluster`: what the scheduler's environment resolves to, printed; nothing started."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from towerflow import taskenv
from towerflow.cli import main

SLURM = {"SLURM_JOB_ID": "1250000", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
         "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"}
GOLDEN_ALL = json.loads((pathlib.Path(__file__).parent / "golden.json").read_text())
GOLDEN = [c for c in GOLDEN_ALL if "error" not in c and c.get("expect")]


@pytest.fixture
def environ(monkeypatch):
    for name in taskenv.scheduler_variables(os.environ):
        monkeypatch.delenv(name)

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)
    return set_env


def test_no_scheduler_is_not_distributed(environ, capsys):
    assert main(["cluster"]) == 0 and "not distributed" in capsys.readouterr().out
    assert main(["cluster", "--json"]) == 0 and json.loads(capsys.readouterr().out) == {"scheduler": None, "cluster": {}, "task": None}


def test_json_has_tf_configs_shape_and_what_was_detected(environ, capsys):
    environ(**SLURM)
    assert main(["cluster", "--json", "--ps", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scheduler"] == "slurm" and out["task"] == {"type": "worker", "index": 0}
    assert out["cluster"] == {"worker": ["node01:20001", "node02:20000", "node02:20001"], "ps": ["node01:20000"]}
    assert (out["local_rank"], out["device"], out["from"]) == (1, "gpu:1", SLURM | {})


def test_flags_win_over_the_role_variables_and_text_names_the_task(environ, capsys):
    environ(**SLURM, TOWERFLOW_PS_TASKS="2")
    assert main(["cluster", "--chief"]) == 0
    out = capsys.readouterr().out
    assert "scheduler: slurm" in out and "/job:evaluator" not in out and "task:      /job:ps/task:0" in out
    assert main(["cluster", "--ps", "0", "--evaluator"]) == 0 and "'evaluator': ['node01:20000']" in capsys.readouterr().out


@pytest.mark.parametrize("argv, env, message", [
    (["--scheduler", "slrum"], {}, "unknown scheduler 'slrum'"),
    (["--scheduler", "mpi"], {}, "none of OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK is set"),
    ([], {**SLURM, "SLURM_DISTRIBUTION": "cyclic"}, "--distribution=block"),
    (["--ps", "9"], SLURM, "need 10 ranks or more"),
])
def test_bad_input_is_named_and_exits_2(environ, capsys, argv, env, message):
    environ(**env)
    assert main(["cluster", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_elastic_worker_only_pytorchjob_pod_is_refused_with_the_true_reason_and_the_fix(environ, capsys):
    """The operator sets no MASTER_ADDR there (the job has no Master replica): towerflow says so, and what to run."""
    case = next(c for c in GOLDEN_ALL if c["name"].startswith("pytorchjob elastic without a Master replica: the pod"))
    environ(**case["env"])
    assert main(["cluster", "--json"]) == 2
    err = capsys.readouterr().err
    assert "PET_RDZV_ENDPOINT='el-worker-0:23456', PET_NNODES='1:4'" in err
    assert "MASTER_ADDR, RANK and WORLD_SIZE only in the pods of a job with a Master replica" in err
    assert "`torchrun -m towerflow launch train.py`" in err and "add a Master replica" in err
    assert "in every PyTorchJob pod" not in err


def test_a_bad_ps_count_is_an_argument_error(environ):
    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "--ps", "-1"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("case", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_the_command_prints_what_each_recorded_environment_resolves_to(environ, capsys, case):
    """`towerflow cluster --json` in every recorded pod / slot environment (Kubernetes TFJob and PyTorchJob,
    torchrun restarts, Slurm, MPI): the JSON the golden table expects, from the command itself."""
    environ(**case["env"])
    argv = ["cluster", "--json"] + (["--scheduler", case["scheduler"]] if case.get("scheduler") else [])
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k: out[k] for k in case["expect"]} == case["expect"]
