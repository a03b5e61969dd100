"""Where `--ps-replicas 2` spends its CPU: each task process's CPU time per training step, and the cores' idle time,
with and without replication, launches alternated (docs/benchmarks.md, "Replicated ps shards").

    PYTHONPATH=src python benchmarks/replicas_cpu.py --launches 3

Each launch is ps_replicas.py's `mlp` job (`towerflow launch --ps 2 --workers 2`, the small MLP, one torch thread
per process) with enough steps that a window of `--window` seconds, `--after` seconds in, falls inside training.
Over the window it reads every task process's user and system time (`/proc/PID/stat`; the system time is
printed in brackets) and the machine's idle time
(`/proc/stat`); a step is one of either worker's, counted from the job's own steps/s. On a machine whose cores the
job saturates, steps/s is about the cores over the sum of the CPU per step, less the idle share.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TICK = os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for child in map(int, out) for d in (child, *_descendants(child))]


def _cpu_s(pid: int):
    """(user, system) seconds of CPU the process has used, or None once it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def _task(pid: int):
    """The task a process runs ('ps0', 'worker1'), from its environment; None for the launcher and the fork server."""
    try:
        env = dict(e.split(b"=", 1) for e in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in e)
    except OSError:
        return None
    job, index = env.get(b"TOWERFLOW_JOB_NAME"), env.get(b"TOWERFLOW_TASK_INDEX")
    return f"{job.decode()}{index.decode()}" if job and index else None


def _idle():
    ticks = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)


def measure(replicas: int, args) -> dict:
    path = os.pathsep.join(filter(None, [os.path.join(REPO, "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")  # keeps a site folder the caller gives
    launch = [sys.executable, "-m", "towerflow", "launch", "--ps", "2", "--workers", "2", "--ps-replicas", str(replicas),
              os.path.join(HERE, "_replicas_task.py"), str(args.steps), "256"]
    job = subprocess.Popen(launch, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(args.after)
        tasks = {pid: name for pid in _descendants(job.pid) if (name := _task(pid))}
        idle0, cpu0, t0 = _idle(), {pid: _cpu_s(pid) for pid in tasks}, time.monotonic()
        time.sleep(args.window)
        cpu1, t1, idle1 = {pid: _cpu_s(pid) for pid in tasks}, time.monotonic(), _idle()
        output = job.communicate(timeout=args.timeout)[0]
    finally:
        job.kill()
    if job.returncode != 0:
        raise RuntimeError(f"--ps-replicas {replicas} exited {job.returncode}:\n{output[-3000:]}")
    rate = sum(float(r) for r in re.findall(r"steps/s ([0-9.]+)", output))
    steps = rate * (t1 - t0)
    if any(cpu0[p] is None or cpu1[p] is None for p in tasks) or len(tasks) != 4:
        raise RuntimeError(f"the window missed a task ({sorted(tasks.values())}): raise --steps or lower --after")
    per_step = {tasks[p]: 1e6 * (sum(cpu1[p]) - sum(cpu0[p])) / steps for p in tasks}
    system = {tasks[p]: 1e6 * (cpu1[p][1] - cpu0[p][1]) / steps for p in tasks}
    return {"steps_per_s": rate, "cpu_us_per_step": dict(sorted(per_step.items())),
            "system_us_per_step": dict(sorted(system.items())),
            "idle": (idle1[0] - idle0[0]) / max(1, idle1[1] - idle0[1])}


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=3, help="launches of each setting, alternated")
    p.add_argument("--steps", type=int, default=40000, help="steps per worker: training must outlast the window")
    p.add_argument("--after", type=float, default=7.0, help="seconds from the launch to the window")
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write every launch's numbers here too")
    args = p.parse_args(argv)
    runs = []
    for launch in range(args.launches):
        for replicas in ((1, 2) if launch % 2 == 0 else (2, 1)):
            run = {"replicas": replicas, **measure(replicas, args)}
            runs.append(run)
            cpu, system = run["cpu_us_per_step"], run["system_us_per_step"]
            print(f"--ps-replicas {replicas}: {run['steps_per_s']:.0f} steps/s; CPU per step (of it the kernel's) "
                  + ", ".join(f"{k} {v:.0f} ({system[k]:.0f})" for k, v in cpu.items())
                  + f" µs, sum {sum(cpu.values()):.0f} µs; cores idle {100 * run['idle']:.1f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"started_load": os.getloadavg(), "runs": runs}, f, indent=1)
    return runs


if __name__ == "__main__":
    main()
