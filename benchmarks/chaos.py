"""Chaos: SIGKILL a random task (or a whole host) every K seconds for a whole run, and report what it cost.

    PYTHONPATH=src .venv/bin/python benchmarks/chaos.py [--hosts 1|3] [--kill task|host|link|lose] [--down 25] [--store etcd] [--every 30]
        [--steps 20000] [--mode async] [--ps 1] [--ps-replicas 1] [--seed 0] [--data MNIST_DIR] [--out DIR] [--json FILE]

The job is `examples/mnist_ps.py` with 1 ps + 2 workers (worker 0 the chief) under `--max-restarts 1000`
(`--ps N` ps tasks, and `--ps-replicas 2` to keep each ps task's part mirrored on another; on 3 hosts
`--ps 2 --ps-replicas 2` puts the two ps tasks on two hosts, a worker beside the second, and `--ps 4` two on each),
a checkpoint every 100 global steps. An undisturbed run of the same job, the chaos run, and an
undisturbed run again (the machine's load drifts); all run `--steps` global steps, so the efficiency
is the undisturbed runs' mean wall time over the chaos run's (its global steps/s against theirs).
`--hosts 1`: one `towerflow launch` runs the whole cluster. `--hosts 3` (root, `ip netns`): the ps and the two workers each on a network-namespace
host with a launcher of its own (`--cluster FILE`); `--kill host` there kills a host's launcher with
every task on it, then starts that launcher again, as a machine that reboots; `--kill link` unplugs a
host's network cable for `--down` s, every process on it living on, cut off (a partition); `--kill lose`
(with `--ps 2 --ps-replicas 2`) kills the host that holds ps 0 alone, once, and never starts it again: its
part goes on at its backup, and the recovery is the chief's line saying so.

The kills come every K s from the first step on, at a random task each time; the next kill waits for
the last one's recovery (a second loss during a recovery is another test). Reported: exit code, test
accuracy of both runs, efficiency, every kill with its recovery time (SIGKILL to the line that says
the task is back), and the global steps lost (what the workers report losing at each ps restore).
The load average is printed with the result: on a shared machine it says how much to trust the figure.
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
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "mnist-t10k"
WORKERS = ("/job:worker/task:0", "/job:worker/task:1")
_STARTED = re.compile(r"(/job:\w+/task:\d+) \(pid (\d+)\)")
_RESTARTED = re.compile(r"(/job:\w+/task:\d+) \(pid \d+\) .*restarting it \(\d+ of \d+\) as pid (\d+)")
_LOST_STEPS = re.compile(r"lost: (\d+) global steps since that checkpoint")
_ACCURACY = re.compile(r"\[worker:0\] test accuracy: (\d\.\d+)")


# after a host was cut off: a worker connected again to a ps task that had lived on behind the cut, or a task back
_RECONNECTED = re.compile(r"had not stopped \(its heartbeats went on\): connected again| is back \(| rejoined training")


def recovered_line(task: str) -> re.Pattern:
    """The line that says `task` is back after a kill: a restored ps (the workers say so), a worker training
    again, or a restart that found the training over (it exits 0)."""
    return re.compile(re.escape(task) + r":?( is back| rejoined training| \(restart \d+\) has nothing to rejoin)")


class Output:
    """Launcher output files, read as they grow, each line stamped with when it was seen."""

    def __init__(self) -> None:
        self.files: List[Path] = []
        self._offsets: Dict[Path, int] = {}
        self.lines: List[Tuple[float, str]] = []

    def follow(self, path: Path) -> None:
        self.files.append(path)
        self._offsets[path] = 0

    def poll(self) -> None:
        now = time.monotonic()
        for path in self.files:
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets[path])
                data = f.read()
            cut = data.rfind(b"\n") + 1  # a line still being written waits for its end
            self._offsets[path] += cut
            self.lines += [(now, line) for line in data[:cut].decode(errors="replace").splitlines()]

    def first(self, pattern: re.Pattern, after: float = 0.0) -> Optional[float]:
        self.poll()
        return next((t for t, line in self.lines if t >= after and pattern.search(line)), None)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def pids(self) -> Dict[str, int]:
        """Each task's current process id, from the launchers' `started` and `restarting it` lines."""
        self.poll()
        out: Dict[str, int] = {}
        for _, line in self.lines:
            restarted = _RESTARTED.search(line)
            if restarted:
                out[restarted.group(1)] = int(restarted.group(2))
            elif "started " in line:
                out.update({task: int(pid) for task, pid in _STARTED.findall(line)})
        return out


class OneHost:
    """The whole cluster under one `towerflow launch`."""

    def __init__(self, work: Path, job_argv: List[str], env: Dict[str, str], ps: int = 1, ps_replicas: int = 1):
        self.output = Output()
        self.tasks = tuple(f"/job:ps/task:{i}" for i in range(ps)) + WORKERS
        log = work / "launch.log"
        argv = [sys.executable, "-m", "towerflow", "launch", "--ps", str(ps), "--workers", "2", "--max-restarts", "1000",
                "--ps-replicas", str(ps_replicas), "--logdir", str(work / "logdir"), *job_argv]
        self.proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=str(ROOT), start_new_session=True)
        self.output.follow(log)

    def running(self) -> bool:
        return self.proc.poll() is None

    def targets(self) -> List[str]:
        return list(self.tasks)

    def kill_task(self, task: str) -> bool:
        pid = self.output.pids().get(task)
        return pid is not None and kill_pid(pid)

    def exit_code(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        _killpg(self.proc.pid)


def kill_pid(pid: int) -> bool:
    """SIGKILL `pid`; False when it had already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_job(make_job, kill: Optional[str], every: float, timeout: float, rng: random.Random,
            max_kills: Optional[int] = None, down: float = 25.0) -> dict:
    """One run: kills every `every` s (none when `kill` is None; at most `max_kills`) until the job ends. A cut
    (`kill="link"`) unplugs a host for `down` s; its recovery is the first reconnection or restore after it (none
    when no task noticed it: a cut shorter than ZeroMQ's heartbeat timeout may pass unseen)."""
    job = make_job()
    t0 = time.monotonic()
    kills: List[dict] = []
    try:
        first_step = None
        while job.running() and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
            job.output.poll()  # every line stamped within 50 ms of its writing: the recovery times rest on it
            if first_step is None:
                first_step = job.output.first(re.compile(r"\[worker:0\] step \d+/"))
                next_kill = (first_step or 0) + every
                continue
            if kill is None or time.monotonic() < next_kill or (max_kills is not None and len(kills) >= max_kills):
                continue
            if kills and kills[-1]["recovered_s"] is None:  # the last kill is not recovered yet: wait for it
                back = job.output.first(_recovery_of(kill, kills[-1]["task"]), after=kills[-1]["at"])
                if back is None and not (kill == "link" and time.monotonic() > kills[-1]["at"] + down + 90):
                    continue
                kills[-1]["recovered_s"] = None if back is None else round(back - kills[-1]["at"], 2)
                kills[-1]["checked"] = True
            target = rng.choice(job.ps_only_targets() if kill == "lose" else job.targets())
            at = time.monotonic()
            hit = {"host": lambda: job.kill_host(target), "link": lambda: job.cut_host(target, down),
                   "lose": lambda: job.kill_host(target, again=False)}.get(kill, lambda: job.kill_task(target))
            if hit():
                kills.append({"task": target, "at": at, "after_start_s": round(at - t0, 1), "recovered_s": None})
            next_kill = at + every
        if job.running():
            raise SystemExit(f"the run did not end within {timeout:.0f} s:\n{job.output.text()[-3000:]}")
        code = job.exit_code(30)
        wall = time.monotonic() - t0
    finally:
        job.close()
    job.output.poll()
    text = job.output.text()
    for k in kills:
        if k["recovered_s"] is None and not k.pop("checked", False):
            back = job.output.first(_recovery_of(kill, k["task"]), after=k["at"])
            k["recovered_s"] = None if back is None else round(back - k["at"], 2)
        k.pop("checked", None)
    accuracy = _ACCURACY.search(text)
    return {"exit_code": code, "wall_s": round(wall, 2), "accuracy": float(accuracy.group(1)) if accuracy else None,
            "kills": [{k: v for k, v in kill.items() if k != "at"} for kill in kills],
            "steps_lost": _steps_lost(job.output), "tail": text[-2000:] if code else ""}


def _recovery_of(kill: Optional[str], task: str) -> re.Pattern:
    if kill == "lose":  # the chief trains on with the lost ps task's part at its backup
        return re.compile(r"\[worker:0\] .*" + re.escape(task) + r" was not back within .* served by its backup")
    return _RECONNECTED if kill == "link" else recovered_line(task)


def _steps_lost(output: Output) -> int:
    """Global steps lost at ps restores: each restore's loss, as its workers report it (once per restore)."""
    restores = re.compile(r"/job:ps/task:\d+ is back")
    lost, seen = 0, set()
    for stamp, line in output.lines:
        found = _LOST_STEPS.search(line)
        if found and restores.search(line):
            key = round(stamp, 0)  # the workers of one restore say it within a second of each other
            if key not in seen and key - 1 not in seen:
                seen.add(key)
                lost += int(found.group(1))
    return lost


def summarize(cleans: List[dict], chaos: dict, every: float) -> dict:
    """Efficiency: the undisturbed runs' mean wall time over the chaos run's, for the same global steps."""
    times = [k["recovered_s"] for k in chaos["kills"] if k["recovered_s"] is not None]
    clean_wall = statistics.mean(c["wall_s"] for c in cleans) if cleans else None
    return {
        "every_s": every,
        "kills": len(chaos["kills"]),
        "unrecovered": sum(k["recovered_s"] is None for k in chaos["kills"]),
        "clean_wall_s": [c["wall_s"] for c in cleans], "chaos_wall_s": chaos["wall_s"],
        "efficiency": round(clean_wall / chaos["wall_s"], 3) if cleans and chaos["exit_code"] == 0 else None,
        "accuracy_clean": [c["accuracy"] for c in cleans], "accuracy_chaos": chaos["accuracy"],
        "recovery_median_s": statistics.median(times) if times else None,
        "recovery_worst_s": max(times) if times else None,
        "steps_lost": chaos["steps_lost"],
        "load_average": os.getloadavg(),
    }


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--hosts", type=int, choices=(1, 3), default=1)
    p.add_argument("--kill", choices=("task", "host", "link", "lose"), default="task",
                   help="a task (SIGKILL), a whole host (every process; then its launchers again), a host's link "
                        "(unplugged for --down s, every process living on), or a ps host lost for good (once; "
                        "--hosts 3 --ps 2 --ps-replicas 2)")
    p.add_argument("--down", type=float, default=25.0,
                   help="--kill link: seconds each cut lasts (above TOWERFLOW_HEARTBEAT_TIMEOUT, 15 s, to be seen)")
    p.add_argument("--store", choices=("embedded", "etcd"), default="embedded",
                   help="--hosts 3: the rendezvous in the coordinator task (embedded) or a 3-member etcd on the hosts")
    p.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--steps", type=int, default=20000, help="global steps of each run")
    p.add_argument("--mode", default="async", choices=("async", "sync", "ssp"))
    p.add_argument("--ps", type=int, default=1, help="how many ps tasks (--hosts 3: 1, or 2 or 4 with --ps-replicas 2)")
    p.add_argument("--ps-replicas", type=int, default=1, choices=(1, 2), help="each ps part's copies")
    p.add_argument("--max-kills", type=int, default=None, help="stop killing after this many")
    p.add_argument("--seed", type=int, default=0, help="which task each kill picks")
    p.add_argument("--data", default=str(DATA), help="the MNIST IDX folder (the digits stand in without it)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each run may take")
    p.add_argument("--no-clean", action="store_true", help="skip the undisturbed run (no efficiency then)")
    p.add_argument("--out", help="keep the runs' logs and logdirs here")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` or a scheduler's stop: close the job's processes
    if args.kill == "lose" and (args.hosts, args.ps_replicas) != (3, 2):
        p.error("--kill lose needs --hosts 3 --ps 2 (or 4) --ps-replicas 2: the lost ps tasks' parts live on at their "
                "backups")
    if args.kill == "lose":
        args.max_kills = 1  # one host to lose: the job needs the others
    if args.kill in ("host", "link") and args.hosts == 1:
        p.error(f"--kill {args.kill} needs --hosts 3: with one host, losing it ends the job by definition")
    if args.hosts == 3 and (args.ps, args.ps_replicas) not in ((1, 1), (2, 2), (4, 2)):
        p.error("--hosts 3 runs 1 ps and 2 workers, or with --ps-replicas 2 two or four mirrored ps tasks (--ps 2: one "
                "on each of two hosts; --ps 4: two on each) and 2 workers")
    if args.ps_replicas == 2 and args.ps < 2:
        p.error("--ps-replicas 2 needs --ps 2 or more: a ps part is mirrored on another ps task")
    if args.store == "etcd" and args.hosts == 1:
        p.error("--store etcd needs --hosts 3: on one host the launcher holds the store and outlives every task")
    job_argv = [str(ROOT / "examples" / "mnist_ps.py"), "--data", args.data, "--mode", args.mode,
                "--steps", str(args.steps), "--save-checkpoint-steps", "100"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="towerflow-chaos-"))
    results = {"clean": None, "clean_after": None}
    # clean, chaos, clean again: the machine's load drifts, and the chaos run is held against both
    order = [("chaos", args.kill)] if args.no_clean else [("clean", None), ("chaos", args.kill), ("clean_after", None)]
    for name, kill in order:
        work = out / name
        work.mkdir(parents=True, exist_ok=True)
        if args.hosts == 1:
            make = lambda work=work: OneHost(work, job_argv, env, args.ps, args.ps_replicas)  # noqa: E731
        else:
            from _chaos_hosts import NamespaceHosts

            store = None if args.store == "embedded" else args.store
            make = lambda work=work: NamespaceHosts(work, job_argv, env, store, args.ps_replicas, args.ps)  # noqa: E731
        results[name] = run_job(make, kill, args.every, args.timeout, random.Random(args.seed), args.max_kills,
                                args.down)
        print(f"{name}: exit {results[name]['exit_code']}, {results[name]['wall_s']} s, accuracy "
              f"{results[name]['accuracy']}, {len(results[name]['kills'])} kills", flush=True)
        if results[name]["exit_code"] != 0:
            print(results[name]["tail"], file=sys.stderr)
    result = {"args": vars(args), **results,
              "summary": summarize([r for r in (results["clean"], results["clean_after"]) if r], results["chaos"],
                                   args.every)}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
