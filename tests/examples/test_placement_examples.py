"""The placement examples and the demo run on a CPU-only machine and print what they promise."""

import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multiprocess  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"


def _run(*args, timeout=120):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only output")
def test_placement_basics_logs_in_tf_shape_and_falls_back():
    out, err = _run("examples/placement_basics.py")
    assert f"add: (Add): {CPU0}" in err
    assert "without soft placement: cannot place op 'add' on /device:GPU:0" in out
    assert "[soft placement from /device:GPU:0: this task has no /device:GPU:0" in err
    assert out.count("tensor([2., 4., 6.])") == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only output")
def test_soft_placement_example_reports_each_fallback():
    out, _ = _run("examples/soft_placement.py")
    assert "fell back: matmul (MatMul) asked for /device:GPU:0" in out
    assert "without soft placement: cannot place op 'matmul'" in out


def test_gpu_memory_example_runs_everywhere():
    out, _ = _run("examples/gpu_memory.py", "--fraction", "0.4")
    assert out.startswith("Device mapping:")
    if not torch.cuda.is_available():
        assert "no GPU here" in out


def test_model_parallel_example_learns_and_shows_the_crossing():
    out, _ = _run("examples/model_parallel.py", "--steps", "150")
    accuracy = float(out.split("train accuracy: ")[1].split()[0])
    assert accuracy > 0.85
    moved = int(out.split("moved ")[1].split(" B")[0])
    # The encoder's 64-float activations cross to the head: 150 batches of 64 rows, then 3,200 rows once.
    assert moved == (150 * 64 + 3200) * 64 * 4


def test_demo_runs_the_placement_tour():
    out, _ = _run("-m", "towerflow", "demo", "--placement")
    assert f"add: (Add): {CPU0}" in out
    assert float(out.split("train accuracy ")[1].split()[0]) > 0.9
    assert "Placement summary:" in out
