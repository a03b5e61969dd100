"""What the fork server saves: the same launch with it and without (TOWERFLOW_FORK_SERVER=1 / 0), alternated.

    PYTHONPATH=src .venv/bin/python benchmarks/fork_server.py [--rounds 4] [--steps 600] [--out FILE]

Each launch is `towerflow launch --ps 1 --workers 2 --max-restarts 1 examples/mnist_ps.py --steps S`;
worker 1 is SIGKILLed as soon as the chief prints its first progress line. Per launch: seconds from the
launch to the chief's first progress line (every task started, joined and stepping), from the SIGKILL to
the restarted worker's "rejoined training" line (a restart), and to the launch's exit. Prints each launch,
the medians and the ratios with/without, and writes the raw numbers to FILE (default
benchmarks/results/fork_server.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DATA = os.path.join(REPO, "..", "shared", "data", "mnist-t10k")
FIRST_STEP = re.compile(r"^\[worker:0\] step \d+/")
STARTED = re.compile(r"/job:worker/task:1 \(pid (\d+)\)")
REJOINED = re.compile(r"/job:worker/task:1: rejoined training")


def one_launch(fork_server: bool, steps: int, data: str, timeout: float) -> dict:
    env = {**os.environ, "TOWERFLOW_FORK_SERVER": "1" if fork_server else "0", "PYTHONPATH": os.path.join(REPO, "src")}
    argv = [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "1",
            os.path.join(REPO, "examples", "mnist_ps.py"), "--data", data, "--steps", str(steps)]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    marks, lines = {}, []

    def read() -> None:
        victim = None
        for line in proc.stdout:
            lines.append(line)
            now = time.monotonic() - t0
            found = STARTED.search(line)
            if found and victim is None:
                victim = int(found.group(1))
            if "first_step" not in marks and FIRST_STEP.search(line) and victim is not None:
                marks["first_step"] = now
                os.kill(victim, signal.SIGKILL)
                marks["killed"] = time.monotonic() - t0
            if "killed" in marks and "rejoined" not in marks and REJOINED.search(line):
                marks["rejoined"] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(5)
    wall = time.monotonic() - t0
    if code != 0 or "rejoined" not in marks:
        raise SystemExit(f"launch failed (exit {code}, marks {marks}):\n{''.join(lines[-40:])}")
    return {"fork_server": fork_server, "to_first_step_s": round(marks["first_step"], 2),
            "restart_s": round(marks["rejoined"] - marks["killed"], 2), "wall_s": round(wall, 2),
            "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="launches of each setting, alternated")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--data", default=DATA)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=os.path.join(HERE, "results", "fork_server.json"))
    args = p.parse_args()
    runs = []
    for r in range(args.rounds):
        for fork_server in ((True, False) if r % 2 == 0 else (False, True)):
            run = one_launch(fork_server, args.steps, args.data, args.timeout)
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary = {}
    for key in ("to_first_step_s", "restart_s", "wall_s"):
        on = statistics.median(r[key] for r in runs if r["fork_server"])
        off = statistics.median(r[key] for r in runs if not r["fork_server"])
        summary[key] = {"with": on, "without": off, "ratio": round(on / off, 3)}
        print(f"{key}: with the fork server {on:.2f} s, without {off:.2f} s: {on / off:.2f}x", flush=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(args.out))
    with os.fdopen(fd, "w") as f:
        json.dump({"args": vars(args), "runs": runs, "summary": summary}, f, indent=1)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
