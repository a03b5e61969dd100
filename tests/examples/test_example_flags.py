"""The examples refuse a flag they do not know (a typo must not run the default silently) and accept the
seeds' cluster flags by name, which towerflow.Server reads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
SEED_FLAGS = ["--ps_hosts", "localhost:2222", "--worker_hosts", "localhost:2223,localhost:2224", "--job_name", "worker",
              "--task_index", "1"]


def _module(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["ctr_ps", "mnist_ps", "linear_regression_ps"])
def test_a_mistyped_flag_is_refused_and_the_seeds_cluster_flags_are_accepted(name, capsys):
    parse_args = _module(name).parse_args
    with pytest.raises(SystemExit) as refused:
        parse_args(["--step", "100"])
    assert refused.value.code == 2 and "unrecognized arguments: --step 100" in capsys.readouterr().err
    args = parse_args([*SEED_FLAGS, "--seed", "3"])
    assert args.seed == 3 and args.job_name == "worker" and args.task_index == "1"


@pytest.mark.parametrize("name", ["pi_distributed", "pi_multi_device"])
def test_the_pi_examples_refuse_a_mistyped_flag(name):
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--sample", "10"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --sample 10" in out.stderr
    shown = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"], capture_output=True, text=True,
                           timeout=60)
    assert "--ps_hosts" in shown.stdout and "--task_index" in shown.stdout
