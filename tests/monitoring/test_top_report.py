"""`towerflow top` and `towerflow report` on a recorded metrics file: golden values."""

import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from towerflow.monitoring import report, top
from towerflow.monitoring.metrics import MetricsWriter, read_metrics

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture
def logdir(tmp_path):
    shutil.copy(DATA / "metrics.jsonl", tmp_path / "metrics.jsonl")
    return tmp_path


def test_reader_skips_the_torn_last_line(logdir):
    records = read_metrics(str(logdir))
    assert len(records) == 7
    assert records[-1]["step"] == 30


def test_top_rows_show_the_newest_values_per_task(logdir):
    rows = {r[0]: r for r in top.rows(read_metrics(str(logdir)), now=1010.0)}
    assert list(rows) == ["ps:0", "worker:0", "worker:1"]
    # task, role, state, device, step, steps/s, loss, staleness, pushed, pulled, rows, replica, data, mem, age
    assert rows["worker:0"] == ["worker:0", "chief", "running", "CPU:0", "30", "11.0", "0.5000", "0.2 (max 1)",
                                "2.0 MB", "4.0 MB", "-", "-", "-", "512", "6s"]
    assert rows["worker:1"][4:8] == ["24", "9.0", "1.5000", "1.3 (max 2)"]
    assert rows["ps:0"][5:8] == ["-", "-", "-"]


def test_top_renders_a_table_with_a_header(logdir):
    text = top.render(read_metrics(str(logdir)), str(logdir), now=1010.0)
    lines = text.splitlines()
    assert "3 tasks, 7 records" in lines[0] and "run running" in lines[0]
    assert lines[1].split() == ["task", "role", "state", "device", "step", "steps/s", "loss", "staleness", "pushed", "pulled", "rows", "(+in",
                                 "-out)", "replica", "data", "(epoch:", "read)", "mem", "MiB", "age"]


def test_top_shows_a_ps_tasks_backup_and_its_lag_or_that_it_is_unreplicated():
    base = {"time": 1000.0, "step": 5, "role": "ps"}
    records = [{**base, "task": "ps:0", "replica_backup": "ps:1", "replica_lag": 2, "replica_degraded": False},
               {**base, "task": "ps:1", "replica_backup": None, "replica_lag": 0, "replica_degraded": True},
               {**base, "task": "ps:2"}]  # --ps-replicas 1
    rows = {r[0]: r for r in top.rows(records, now=1001.0)}
    column = top.COLUMNS.index("replica")
    assert [rows[t][column] for t in ("ps:0", "ps:1", "ps:2")] == ["ps:1 lag 2", "degraded", "-"]


def test_top_shows_where_each_worker_stands_in_its_files():
    base = {"time": 1000.0, "step": 5, "role": "worker"}
    records = [{**base, "task": "worker:0", "data_epoch": 1, "data_records": 250, "data_epoch_records": 1000},
               {**base, "task": "worker:1", "data_epoch": 0, "data_records": 4096}]  # Criteo text: its size unknown
    rows = {r[0]: r for r in top.rows(records, now=1001.0)}
    column = top.COLUMNS.index("data (epoch: read)")
    assert rows["worker:0"][column] == "1: 25%" and rows["worker:1"][column] == "0: 4,096"


def test_report_summary_and_staleness_are_exact(logdir):
    records = read_metrics(str(logdir))
    assert report.staleness_histogram(records) == {0: 21, 1: 8, 2: 11}  # the newest (cumulative) per task, summed
    s = report.summary(records)
    assert s["worker:0"] == {"last_step": 30, "final_loss": 0.5, "best_loss": 0.5, "median_steps_per_sec": 11.0}
    assert s["worker:1"] == {"last_step": 24, "final_loss": 1.5, "best_loss": 1.5, "median_steps_per_sec": 9.0}


def test_report_writes_pngs_and_markdown(logdir):
    written = report.write_report(str(logdir))
    names = sorted(pathlib.Path(p).name for p in written)
    assert names == ["dashboard.png", "loss_vs_step.png", "loss_vs_time.png", "report.md", "staleness.png", "throughput.png"]
    for path in written:
        if path.endswith(".png"):
            assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (logdir / "report" / "report.md").read_text()
    assert "| worker:0 | silent | 30 | 0.5000 | 0.5000 | 11.00 |" in md  # no events, records long ago
    assert "Staleness histogram (pushes per staleness): 0: 21, 1: 8, 2: 11" in md


def test_report_on_an_empty_logdir_says_what_to_do(tmp_path):
    with MetricsWriter(str(tmp_path), "worker:0"):
        pass
    with pytest.raises(ValueError, match="has no metrics records"):
        report.write_report(str(tmp_path))


def test_cli_top_once_and_missing_logdir(logdir, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "towerflow", "top", str(logdir), "--once"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "worker:1" in ok.stdout
    missing = subprocess.run([sys.executable, "-m", "towerflow", "top", str(tmp_path / "nope"), "--once"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "start a job with --logdir" in missing.stdout


def test_a_ps_record_shows_its_update_rate_and_table_rows(tmp_path):
    from towerflow.ps.server.monitor import summary

    service_metrics = {"applied_updates": 40, "updates_per_s": 12.5, "dropped_stale": 3, "staleness_histogram": {0: 40},
                       "bytes_pushed_by_worker": {0: 100, 1: 50}, "bytes_pulled_by_worker": {0: 10},
                       "tables": {"user": {"rows": 1200, "admitted": 1300, "evicted": 100}, "item": {"rows": 5}}}
    with MetricsWriter(str(tmp_path), "ps:0") as w:
        w.write(40, **summary(service_metrics))
    row = top.rows(read_metrics(str(tmp_path)), now=time.time())[0]
    assert row[:6] == ["ps:0", "ps", "running", "-", "40", "12.5"] and row[8:11] == ["150 B", "10 B", "1,205 (+1,300 -100)"]
