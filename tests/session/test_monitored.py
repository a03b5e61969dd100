import os
import pytest
import torch
import torch.nn as nn

from towerflow.monitoring.metrics import read_metrics
from towerflow.session import MonitoredTrainingSession, NanLossError, SessionHook, StopAtStepHook

DATA_X = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
DATA_Y = (DATA_X.sum(1, keepdim=True) > 0).float()


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model, opt):
    idx = torch.randint(0, 200, (16,))  # the data order comes from the RNG the checkpoint saves
    loss = nn.functional.binary_cross_entropy_with_logits(model(DATA_X[idx]), DATA_Y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def _train(logdir, last_step, **options):
    model, opt = _setup()
    losses = []
    with MonitoredTrainingSession(model, opt, logdir=logdir, hooks=[StopAtStepHook(last_step=last_step)],
                                  log_step_count_steps=5, **options) as session:
        while not session.should_stop():
            losses.append(session.run(_step, model, opt).item())
    return model, losses, session


def test_resume_is_exact(tmp_path):
    straight, straight_losses, _ = _train(str(tmp_path / "a"), 20, save_checkpoint_steps=10)
    torch.manual_seed(123)  # the restore must not depend on the state the process happens to be in
    _train(str(tmp_path / "b"), 10, save_checkpoint_steps=10)
    resumed, resumed_losses, session = _train(str(tmp_path / "b"), 20, save_checkpoint_steps=10)
    assert session.restored.step == 10
    assert resumed_losses == straight_losses[10:]  # the same batches, the same updates
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_hooks_run_in_lifecycle_order_and_stop_at_the_step():
    calls = []

    class Recorder(SessionHook):
        def begin(self, s):
            calls.append("begin")

        def after_create_session(self, s):
            calls.append(f"created@{s.global_step}")

        def before_step(self, s):
            calls.append(f"before@{s.global_step}")

        def after_step(self, s, loss):
            calls.append(f"after@{s.global_step}")

        def end(self, s):
            calls.append("end")

    model, opt = _setup()
    with MonitoredTrainingSession(model, opt, hooks=[Recorder(), StopAtStepHook(num_steps=2)]) as session:
        while not session.should_stop():
            session.run(_step, model, opt)
    assert calls == ["begin", "created@0", "before@0", "after@1", "before@1", "after@2", "end"]
    assert session.global_step == 2


def test_chief_only_hooks_are_skipped_on_other_tasks():
    class ChiefOnly(SessionHook):
        runs_on = "chief"

    model, opt = _setup()
    worker = MonitoredTrainingSession(model, opt, is_chief=False, hooks=[ChiefOnly()])
    chief = MonitoredTrainingSession(model, opt, is_chief=True, hooks=[ChiefOnly()])
    assert not any(isinstance(h, ChiefOnly) for h in worker.hooks)
    assert any(isinstance(h, ChiefOnly) for h in chief.hooks)


def test_nan_guard_stops_the_run_with_a_clear_error():
    model, opt = _setup()
    with pytest.raises(NanLossError, match="the loss is nan at step 1"):
        with MonitoredTrainingSession(model, opt) as session:
            session.run(lambda: torch.tensor(float("nan")))


def test_metrics_records_and_checkpoint_events(tmp_path):
    _train(str(tmp_path), 10, save_checkpoint_steps=5)
    records = read_metrics(str(tmp_path))
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [2, 4, 6, 8, 10]  # MetricsHook's windows: every 2 steps at first (FlushRule)
    assert all(r["task"] == "localhost:0" and r["role"] == "chief" and r["steps_per_sec"] > 0 for r in records if "loss" in r)
    expected = "/device:GPU:0" if torch.cuda.is_available() else "/device:CPU:0"
    assert {r["device"] for r in records} == {expected}
    assert [r["event"] for r in records if "event" in r] == ["start", "checkpoint ckpt-0000000000.pt",
                                                             "checkpoint ckpt-0000000005.pt", "checkpoint ckpt-0000000010.pt",
                                                             "end"]


def test_worker_zero_is_chief_without_a_chief_job(monkeypatch):
    from towerflow.session.monitored import task_context

    monkeypatch.setenv("TOWERFLOW_JOB_NAME", "worker")
    monkeypatch.setenv("TOWERFLOW_TASK_INDEX", "0")
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:2"], "ps": ["c:3"]}}')
    assert task_context().is_chief
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"chief": ["d:4"], "worker": ["a:1", "b:2"]}}')
    assert not task_context().is_chief
    monkeypatch.setenv("TOWERFLOW_JOB_NAME", "chief")
    assert task_context().is_chief


def test_summaries_go_to_tensorboard_when_it_is_installed(tmp_path, monkeypatch):
    import sys
    import types

    written = []

    class FakeWriter:
        def __init__(self, logdir, **options):
            written.append(("open", logdir))

        def add_scalar(self, tag, value, step, walltime=None):
            written.append((tag, step))

        def close(self):
            written.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _train(str(tmp_path), 10, save_summaries_steps=5)
    # the metrics records' numbers, one TensorBoard run per task (monitoring/tensorboard.py)
    assert written[0] == ("open", os.path.join(str(tmp_path), "tensorboard", "localhost_0"))
    assert [w for w in written if w[0] == "loss"] == [("loss", s) for s in (2, 4, 6, 8, 10)]
    assert ("steps_per_sec", 10) in written and written[-1] == ("close",)


def test_progress_bar_only_on_a_terminal():
    import io

    from towerflow.session import ProgressHook

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model, opt = _setup()
    for stream, expect_bar in ((io.StringIO(), False), (Terminal(), True)):
        hook = ProgressHook(stream)
        with MonitoredTrainingSession(model, opt, hooks=[hook, StopAtStepHook(num_steps=3)], progress=False) as s:
            while not s.should_stop():
                s.run(_step, model, opt)
        assert (hook.bar is not None) == expect_bar
        assert ("3/3" in stream.getvalue()) == expect_bar
