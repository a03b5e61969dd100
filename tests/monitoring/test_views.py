"""The monitoring views: enough points for a curve, plotted series, run and task states, `q`, TensorBoard, the demo's last lines."""

import json
import os

import pytest
import torch
from torch import nn

from towerflow.cli import demo
from towerflow.monitoring import _screen, report, top
from towerflow.monitoring.accumulator import FlushRule, StepAccumulator
from towerflow.monitoring.metrics import MetricsWriter, read_metrics
from towerflow.monitoring.plots import Panel, ema, spans_decades
from towerflow.monitoring.runstate import run_state
from towerflow.session import MonitoredTrainingSession, StopAtStepHook

pytestmark = pytest.mark.multiprocess  # starts processes


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _flushes(local_steps, rule=FlushRule(), step_secs=0.001):
    clock = _Clock()
    window, points = StepAccumulator(rule, clock), 0
    for local in range(1, local_steps + 1):
        clock.now += step_secs
        window.add(1.0)
        if window.is_due(local):
            window.flush()
            points += 1
    return points + (window.pending > 0)


def test_a_1000_step_run_on_two_workers_gives_each_at_least_100_points():
    assert _flushes(500) >= 100  # 1,000 global steps, 500 per worker
    assert _flushes(1_000_000) < 3000  # the spacing grows: a long run stays a small file
    assert _flushes(20, step_secs=30.0) == 20  # slow steps: a point at least every max_secs


def test_the_window_gives_mean_loss_and_rates():
    clock = _Clock()
    window = StepAccumulator(FlushRule(min_steps=4), clock)
    for loss in (1.0, 2.0, float("nan"), 3.0):
        clock.now += 0.5
        window.add(loss, samples=8)
    assert window.is_due(4)
    assert window.flush() == {"loss": 2.0, "steps_per_sec": 2.0, "samples_per_sec": 16.0}
    assert window.pending == 0
    with pytest.raises(ValueError, match="min_steps >= 1"):
        FlushRule(min_steps=0)


def test_a_real_session_records_a_curve_and_the_report_plots_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 4), torch.randn(64, 1)

    def step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    with MonitoredTrainingSession(model, opt, logdir=str(tmp_path), hooks=[StopAtStepHook(last_step=300)],
                                  log_step_count_steps=0, save_checkpoint_secs=None, progress=False) as session:
        while not session.should_stop():
            session.run(step)
    records = read_metrics(str(tmp_path))
    assert [r["event"] for r in records if "event" in r] == ["start", "end"]
    loss_panel = {p.name: p for p in report.panels(records)}["loss_vs_step"]
    (points,) = loss_panel.curves.values()
    assert len(points) >= 100 and all(v > 0 for _, v in points)
    written = report.write_report(str(tmp_path))
    assert {os.path.basename(p) for p in written} >= {"dashboard.png", "loss_vs_step.png", "report.md"}
    assert "finished" in (tmp_path / "report" / "report.md").read_text()


def test_smoothing_and_log_scale():
    assert ema([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no pull towards zero at the start
    assert spans_decades([2.0, 0.5, 0.001]) and not spans_decades([2.0, 0.5, 0.05])
    assert Panel("p", "t", "x", "y", {"a": [(0, 2.0), (1, 0.001)]}).wants_log()
    assert Panel("p", "t", "x", "y", {"a": []}).is_empty


def _r(t, task, **fields):
    return {"time": float(t), "task": task, "step": fields.pop("step", 0), **fields}


def test_task_states_running_finished_failed_restarted():
    records = [
        _r(0, "launcher", role="launcher", event="run start"),
        _r(1, "ps:0", role="ps", event="start"),
        _r(1, "worker:0", role="chief", event="start"),
        _r(1, "worker:1", role="worker", event="start"),
        _r(2, "worker:1", step=5, loss=1.0),
        _r(3, "launcher", role="launcher", event="exit", exit_task="worker:1", exit_code=-9, restarts=0),
        _r(4, "worker:1", role="worker", event="start", restarts=1),
        _r(5, "worker:0", event="failed", error="RuntimeError: boom"),
    ]
    state = run_state(records, now=6.0)
    assert {t: s.describe() for t, s in state.tasks.items()} == {
        "ps:0": "running", "worker:0": "failed", "worker:1": "running, restarted 1x"}
    assert state.state == "running" and state.restarts == 1
    finished = records + [_r(6, t, event="end") for t in ("ps:0", "worker:1")]
    assert run_state(finished, now=7.0).state == "failed"  # worker:0 failed and nothing runs
    ended = records + [_r(7, "launcher", role="launcher", event="run end", exit_code=1)]
    assert run_state(ended).describe().startswith("FAILED (exit code 1)")
    ok = [_r(1, "w:0", event="start"), _r(2, "w:0", event="end")]
    assert run_state(ok, now=1e9).state == "finished"
    assert run_state([_r(1, "w:0", loss=1.0)], now=1000.0).state == "silent"  # no events, no news


def test_top_shows_every_task_with_its_state_and_the_runs_state(tmp_path):
    with MetricsWriter(str(tmp_path), "launcher", role="launcher") as w:
        w.write(0, event="run start")
    for task, role in (("ps:0", "ps"), ("worker:0", "chief"), ("worker:1", "worker")):
        with MetricsWriter(str(tmp_path), task, role=role) as w:
            w.write(0, event="start")
            w.write(10, loss=0.5, steps_per_sec=3.0)
            w.write(10, event="end")
    text = top.render(read_metrics(str(tmp_path)), "D")
    assert "run finished in" in text.splitlines()[0] and "3 tasks" in text.splitlines()[0]
    rows = {line.split()[0]: line.split() for line in text.splitlines()[3:6]}
    assert sorted(rows) == ["ps:0", "worker:0", "worker:1"] and all(r[2] == "finished" for r in rows.values())
    assert "the run is over" in text


def test_q_quits_and_a_finished_run_is_drawn_once():
    assert _screen.is_quit("q") and _screen.is_quit("\x1b") and not _screen.is_quit("x") and not _screen.is_quit(None)

    class Out:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return False

    frames = []
    keys = iter(["x", "q"])
    assert _screen.show(lambda: frames.append(1) or "f", Out(), watch=60, keys=lambda timeout: next(keys)) == 0
    assert len(frames) == 1  # `x` is ignored, `q` quits before the next frame
    frames.clear()
    _screen.show(lambda: frames.append(1) or "f", Out(), watch=60, done=lambda: True, keys=lambda t: None)
    assert len(frames) == 1


def test_tensorboard_gets_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from towerflow.monitoring.tensorboard import run_dir

    with MetricsWriter(str(tmp_path), "worker:0", tensorboard=True) as w:
        for step in range(1, 4):
            w.write(step, loss=1.0 / step, steps_per_sec=10.0, staleness={"0": 1, "2": 1})
    events = EventAccumulator(run_dir(str(tmp_path), "worker:0"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert events.Scalars("staleness_mean")[0].value == pytest.approx(1.0)


def test_the_demos_closing_lines_are_short_and_say_how_to_look(tmp_path):
    logdir = tmp_path / "runs" / "demo-1"
    (logdir / "report").mkdir(parents=True)
    (logdir / "ckpt-0000000010.json").write_text(json.dumps({}))
    written = [str(logdir / "report" / "report.md"), str(logdir / "report" / "dashboard.png")]
    lines = demo.closing_lines(demo.artefacts(str(logdir), written), cwd=str(tmp_path))
    assert [line.split()[:2] for line in lines] == [
        ["checkpoint", "runs/demo-1/ckpt-0000000010.pt"], ["metrics", "runs/demo-1/metrics.jsonl"],
        ["report", "runs/demo-1/report/report.md"], ["dashboard", "runs/demo-1/report/dashboard.png"]]
    assert lines[1].endswith(f"towerflow top {logdir}") and lines[2].endswith(f"towerflow report {logdir}")
    assert all(len(line) < 160 for line in lines)


def test_a_plain_loop_with_progress_records_its_curve_under_a_logdir(tmp_path):
    """Scripts without MonitoredTrainingSession (towerflow.Progress in a plain loop) write metrics too."""
    import towerflow
    from towerflow.monitoring.metrics import read_metrics

    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    with towerflow.Progress(strategy, 1000, logdir=str(tmp_path), bar=False, stream=open(os.devnull, "w")) as progress:
        for step in range(1000):
            progress.update(1.0 / (step + 1))
    records = read_metrics(str(tmp_path))
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) >= 100, len(losses)
    assert losses[0] > losses[-1] > 0
    assert [r["event"] for r in records if "event" in r] == ["start", "end"]
