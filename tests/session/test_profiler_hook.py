import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from _cluster_procs import ROOT
from towerflow import ProfilerHook
from towerflow.session import MonitoredTrainingSession, StopAtStepHook

CTR = str(ROOT / "examples" / "ctr_ps.py")


def _train(last_step, hook, logdir=None, marks=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x):
        with torch.profiler.record_function(f"towerflow_test_step_{session.global_step}"):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss

    with MonitoredTrainingSession(model, opt, logdir=logdir, hooks=[StopAtStepHook(last_step=last_step), hook],
                                  log_step_count_steps=0, progress=False) as session:
        while not session.should_stop():
            session.run(step, torch.randn(16, 8))
    return session


def _named(trace_path):
    events = json.loads(open(trace_path).read())["traceEvents"]
    return {e.get("name", "") for e in events}


def test_the_steps_of_the_window_and_no_others_are_in_the_trace(tmp_path):
    hook = ProfilerHook(start=4, steps=3, output_dir=str(tmp_path / "prof"))
    _train(10, hook)
    assert hook.written == str(tmp_path / "prof" / "localhost0-steps-4-7.trace.json")
    names = _named(hook.written)
    steps = sorted(int(n.rsplit("_", 1)[1]) for n in names if n.startswith("towerflow_test_step_"))
    assert steps == [4, 5, 6]  # steps 4, 5 and 6 ran inside the window; none before or after
    assert "aten::addmm" in names  # the ops themselves, not only the marks
    table = (tmp_path / "prof" / "localhost0-steps-4-7.txt").read_text()
    assert table.startswith("localhost:0: 3 steps from global step 4 to 7")
    assert "aten::addmm" in table and "Self CPU" in table
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["localhost0-steps-4-7.trace.json",
                                                                      "localhost0-steps-4-7.txt"]  # no temporary left


def test_a_run_that_ends_inside_the_window_keeps_what_was_profiled(tmp_path):
    hook = ProfilerHook(start=8, steps=50)
    _train(10, hook, logdir=str(tmp_path))
    assert hook.written == str(tmp_path / "profile" / "localhost0-steps-8-10.trace.json")
    assert {"towerflow_test_step_8", "towerflow_test_step_9"} <= _named(hook.written)


def test_a_window_the_run_never_reaches_writes_nothing(tmp_path):
    hook = ProfilerHook(start=100, steps=2, output_dir=str(tmp_path / "prof"))
    _train(5, hook)
    assert hook.written is None and not (tmp_path / "prof").exists()


@pytest.mark.parametrize("start, steps", [(-1, 5), (10, 0), (2.5, 3)])
def test_a_bad_window_is_refused_with_an_example(start, steps):
    with pytest.raises(ValueError, match=r"expected a global step start >= 0 and steps >= 1.*ProfilerHook\(100, 5\)"):
        ProfilerHook(start, steps)


def test_a_hook_with_nowhere_to_write_says_so_before_training():
    with pytest.raises(ValueError, match="has nowhere to write: give it output_dir= or give the MonitoredTrainingSession "
                                         "a logdir"):
        _train(5, ProfilerHook(0, 2))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_launcher_profiles_each_worker_of_an_unchanged_script(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--profile-steps", "20",
                          "--logdir", str(tmp_path), CTR, "--rows", "2000", "--tables", "4", "--steps", "80",
                          "--test-size", "500")
    assert run.wait(100) == 0, run.describe()
    for worker in (0, 1):
        said = re.search(rf"\[worker:{worker}\] towerflow: worker:{worker}: profiled 10 steps \(global steps (\d+) to "
                         rf"\d+\): (\S+\.trace\.json)", run.err)
        assert said and int(said.group(1)) >= 20, run.describe()
        assert "aten::embedding_bag" in _named(said.group(2))  # its own forward, in its own file
        assert "aten::" in (tmp_path / "profile" / said.group(2).rsplit("/", 1)[1].replace(".trace.json", ".txt")).read_text()


def _launch(*flags):
    return subprocess.run([sys.executable, "-m", "towerflow", "launch", "--workers", "1", *flags, CTR],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_launcher_refuses_to_profile_without_a_logdir():
    done = _launch("--profile-steps", "5")
    assert done.returncode != 0
    assert "--profile-steps 5:10 writes each task's trace and table under the logdir: add --logdir DIR" in done.stderr


@pytest.mark.parametrize("window", ["5:0", "-3", "ten"])
def test_the_launcher_refuses_a_bad_window_with_an_example(window, tmp_path):
    done = _launch(f"--profile-steps={window}", "--logdir", str(tmp_path))
    assert done.returncode == 2 and f"{window!r}: expected START or START:COUNT" in done.stderr
    assert "e.g. --profile-steps 100" in done.stderr


@pytest.mark.gpu
def test_on_a_gpu_the_window_records_its_kernels_and_ranks_the_ops_by_gpu_time(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    hook = ProfilerHook(start=2, steps=3, output_dir=str(tmp_path))

    def step(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    with MonitoredTrainingSession(model, opt, hooks=[StopAtStepHook(last_step=8), hook], log_step_count_steps=0,
                                  progress=False) as session:
        while not session.should_stop():
            session.run(step, torch.randn(64, 256, device="cuda"))
    events = json.loads(open(hook.written).read())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # the GPU's own kernels, not only the launches
    table = open(hook.written.replace(".trace.json", ".txt")).read()
    assert "CUDA" in table.splitlines()[2]  # the header: the GPU's time columns, by which the ops are ranked
