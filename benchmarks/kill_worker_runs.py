"""SIGKILL worker 1 of an async MNIST ps run at a random moment after the
first metrics record, N times; every launch must exit 0 with test accuracy >= 0.95.

    PYTHONPATH=src .venv/bin/python benchmarks/kill_worker_runs.py [--runs 10] [--seed 13] [--out DIR]

Each run is `towerflow launch --ps 1 --workers 2 --max-restarts 2 --logdir DIR examples/mnist_ps.py
--data MNIST --mode async`. A first undisturbed run measures how long worker 1 lives after the first
metrics record (T); each killed run then waits a uniform random 0..T s after that record, so the
kills fall anywhere from the first step to the end of the job (after worker 1 finished included;
a draw that comes after worker 1 exited in that run is reported as not landed, and another run is
drawn, until N kills have landed). Per run it prints the exit code, the test accuracy, the kill moment (seconds after the first record,
the global step there, interpolated from the chief's checkpoint records, and worker 1's own pushes
as the ps counted them) and the recovery time: SIGKILL to the restarted worker's line that says it
rejoined training or had nothing to rejoin. The load average is printed with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "mnist-t10k"
RECOVERED = re.compile(r"\[worker:1\] towerflow: /job:worker/task:1: (rejoined training|\(restart \d+\) has nothing to rejoin)")


class _Launch:
    """One `towerflow launch`, its output lines time-stamped as they arrive (so the recovery is timed)."""

    def __init__(self, logdir: Path, timeout: float):
        argv = [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "2",
                "--logdir", str(logdir), str(ROOT / "examples" / "mnist_ps.py"), "--data", str(DATA), "--mode", "async"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
        self.logdir, self.lines, self.deadline = logdir, [], time.monotonic() + timeout
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=str(ROOT), text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, what: str, condition) -> None:
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > self.deadline:
                raise RuntimeError(f"gave up waiting for {what}; launch output:\n{self.text()[-3000:]}")
            time.sleep(0.02)

    def first_record(self) -> float:
        """Wait for the first metrics record; returns when it was seen (monotonic)."""
        path = self.logdir / "metrics.jsonl"
        self.wait_for("the first metrics record", lambda: path.exists() and path.stat().st_size > 0)
        return time.monotonic()

    def worker_pid(self) -> int:
        found = re.search(r"/job:worker/task:1 \(pid (\d+)\)", self.text())
        assert found, self.text()
        return int(found.group(1))

    def finish(self) -> int:
        try:
            code = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        self._reader.join(5)
        return code

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _step_at(logdir: Path, when: float) -> Optional[int]:
    """The global step at wall time `when`, interpolated between the chief's checkpoint records."""
    records = []
    with open(logdir / "metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if r.get("task") == "worker:0" and str(r.get("event", "")).startswith("checkpoint"):
                records.append((r["time"], r["step"]))
    for (t0, s0), (t1, s1) in zip(records, records[1:]):
        if t0 <= when <= t1:
            return round(s0 + (s1 - s0) * (when - t0) / max(t1 - t0, 1e-9))
    return records[-1][1] if records and when > records[-1][0] else None


def _accuracy(text: str) -> Optional[float]:
    found = re.search(r"\[worker:0\] test accuracy: (\d\.\d+)", text)
    return float(found.group(1)) if found else None


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def calibrate(folder: Path, timeout: float) -> float:
    """Seconds from the first metrics record to worker 1's exit in an undisturbed launch."""
    run = _Launch(folder / "calibration", timeout)
    try:
        start = run.first_record()
        pid = run.worker_pid()
        run.wait_for("worker 1 to exit", lambda: not _is_running(pid))
        lasted = time.monotonic() - start
        code = run.finish()
    finally:
        run.stop()
    if code != 0:
        raise SystemExit(f"the undisturbed run failed (exit {code}):\n{run.text()[-3000:]}")
    return lasted


def killed_run(folder: Path, delay: float, timeout: float) -> dict:
    run = _Launch(folder, timeout)
    try:
        seen = run.first_record()
        pid = run.worker_pid()
        time.sleep(max(0.0, seen + delay - time.monotonic()))  # the random moment itself, not a wait for an event
        load = os.getloadavg()[0]
        killed_wall, killed = time.time(), time.monotonic()
        if _is_running(pid):  # else worker 1 had already exited: the draw fell after its end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = run.finish()
    finally:
        run.stop()
    text = run.text()
    alive = "/job:worker/task:1 (pid %d) was killed by signal 9" % pid in text  # what the launcher saw
    recovered = next((t for t, line in run.lines if RECOVERED.search(line)), None)
    kept = re.search(r"the ps kept its (\d+) earlier pushes", text)
    return {
        "exit": code, "accuracy": _accuracy(text), "killed": alive, "delay_s": round(delay, 2),
        "step": _step_at(folder, killed_wall), "worker1_pushes": int(kept.group(1)) if kept else None,
        "recovery_s": round(recovered - killed, 2) if (alive and recovered) else None,
        "how": ("nothing to rejoin (cluster ended)" if "has nothing to rejoin" in text else
                "rejoined, had finished" if "lost: nothing: it had finished" in text else "rejoined" if alive else "-"),
        "load": round(load, 2), "restarts": len(re.findall(r"was killed by signal 9|exited with code", text)),
        "tail": text[-2500:] if code != 0 else "",
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one launch may take")
    p.add_argument("--out", default=None, help="keep the runs' logdirs here (default: a temporary folder)")
    args = p.parse_args(argv)
    if not DATA.is_dir():
        raise SystemExit(f"MNIST-t10k not found at {DATA}")
    import torch

    folder = Path(args.out or tempfile.mkdtemp(prefix="kill_worker_runs."))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}; runs in {folder}", flush=True)
    window = calibrate(folder, args.timeout)
    print(f"undisturbed: worker 1 exits {window:.1f} s after the first metrics record; kills drawn from 0..{window:.1f} s",
          flush=True)
    rng = random.Random(args.seed)
    rows: List[dict] = []
    print("run | exit | accuracy | kill at (s after 1st record) | global step | worker 1 pushes | recovery (s) | how | load")
    while sum(r["killed"] for r in rows) < args.runs and len(rows) < 2 * args.runs:  # a draw after worker 1's exit is redrawn
        i = len(rows) + 1
        row = killed_run(folder / f"run{i:02d}", rng.uniform(0.0, window), args.timeout)
        rows.append(row)
        print(f"{i} | {row['exit']} | {row['accuracy']} | {row['delay_s']} | {row['step']} | {row['worker1_pushes']} | "
              f"{row['recovery_s']} | {row['how'] if row['killed'] else 'not landed: worker 1 had exited'} | {row['load']}",
              flush=True)
        if row["tail"]:
            print(row["tail"], flush=True)
    landed = [r for r in rows if r["killed"]]
    times = [r["recovery_s"] for r in landed if r["recovery_s"] is not None]
    ok = sum(r["exit"] == 0 and (r["accuracy"] or 0) >= 0.95 for r in landed)
    print(f"{ok} of {len(landed)} killed runs exited 0 with accuracy >= 0.95 ({len(rows) - len(landed)} draws fell after "
          f"worker 1's exit and were drawn again; those runs exited {[r['exit'] for r in rows if not r['killed']]})")
    if times:
        print(f"recovery: median {statistics.median(times):.2f} s, worst {max(times):.2f} s over {len(times)} kills")
    with open(folder / "kill_worker_runs.json", "w") as f:
        json.dump({"window_s": window, "runs": rows}, f, indent=1)
    return 0 if landed and ok == len(landed) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
