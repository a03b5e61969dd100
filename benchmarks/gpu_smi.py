"""`towerflow smi` against `nvidia-smi` on a real GPU.

A child process keeps the GPU busy (a matmul loop holding ~`--hold-gib` GiB); then, `--samples`
times, `nvidia-smi --query-gpu ...` / `--query-compute-apps ...` and `towerflow smi --json` are
started in the same instant and their readings printed side by side: utilisation, memory used and
total, and the processes (pid and memory). Then `towerflow smi --watch 0.5` runs for ~3 s and is
stopped with Ctrl-C (SIGINT): it should have drawn several frames and exit cleanly.

    PYTHONPATH=src python3 benchmarks/gpu_smi.py [--samples 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

LOAD = """
import sys, time, torch
x = torch.empty(int({gib} * 2**30), dtype=torch.uint8, device="cuda")
a = torch.randn(4096, 4096, device="cuda")
print("ready", flush=True)
end = time.time() + {seconds}
while time.time() < end:
    for _ in range(20):
        a = (a @ a).tanh_()
    torch.cuda.synchronize()
"""


def _nvidia_smi() -> subprocess.Popen:
    gpu = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]
    apps = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    return subprocess.Popen(["sh", "-c", f"{' '.join(gpu)}; echo ---; {' '.join(apps)}"], stdout=subprocess.PIPE, text=True)


def _parse_nvidia(text: str) -> dict:
    gpus_part, _, apps_part = text.partition("---")
    gpus = []
    for line in gpus_part.strip().splitlines():
        index, util, used, total = [v.strip() for v in line.split(",")]
        gpus.append({"index": int(index), "utilization_pct": int(util), "memory_used_mib": int(used),
                     "memory_total_mib": int(total)})
    apps = []
    for line in apps_part.strip().splitlines():
        pid, used = [v.strip() for v in line.split(",")]
        apps.append({"pid": int(pid), "memory_mib": int(used)})
    return {"gpus": gpus, "processes": apps}


def sample(env: dict) -> dict:
    ours = subprocess.Popen([sys.executable, "-m", "towerflow", "smi", "--json"], stdout=subprocess.PIPE, text=True, env=env)
    theirs = _nvidia_smi()
    started = time.time()
    ours_out, _ = ours.communicate(timeout=60)
    theirs_out, _ = theirs.communicate(timeout=60)
    snap = json.loads(ours_out)
    return {"time": started, "towerflow": {"gpus": [{k: g[k] for k in ("index", "utilization_pct", "memory_used_mib",
                                                                       "memory_total_mib")} for g in snap["gpus"]],
                                           "processes": [{"pid": p["pid"], "memory_mib": p["memory_mib"]}
                                                         for g in snap["gpus"] for p in g["processes"]]},
            "nvidia_smi": _parse_nvidia(theirs_out)}


def watch(env: dict) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "towerflow", "smi", "--watch", "0.5", "--no-color"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(3)  # the frames to count: --watch 0.5 draws one every half second
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    frames = out.count(socket.gethostname())  # each frame starts with the host's name
    return {"returncode": proc.returncode, "frames": frames, "stderr_tail": err[-500:]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--hold-gib", type=float, default=2.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        raise SystemExit("nvidia-smi is not on PATH: run this on a machine with an NVIDIA driver")
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")}
    load = subprocess.Popen([sys.executable, "-c", LOAD.format(gib=args.hold_gib, seconds=20 + 3 * args.samples)],
                            stdout=subprocess.PIPE, text=True)
    try:
        if load.stdout.readline().strip() != "ready":
            raise SystemExit(f"the load process failed (rc={load.wait()})")
        time.sleep(2)  # let utilisation settle
        samples = [sample(env) for _ in range(args.samples)]
        watched = watch(env)
    finally:
        load.kill()
        load.wait()
    print(f"load pid {load.pid}, holding {args.hold_gib} GiB")
    print(f"{'':>3} {'util % (tf / smi)':>18} {'used MiB (tf / smi)':>22} {'total MiB':>18}   processes (tf | smi)")
    for s in samples:
        for ours, theirs in zip(s["towerflow"]["gpus"], s["nvidia_smi"]["gpus"]):
            print(f"[{ours['index']}] {ours['utilization_pct']:>8} / {theirs['utilization_pct']:<7} "
                  f"{ours['memory_used_mib']:>10} / {theirs['memory_used_mib']:<9} "
                  f"{ours['memory_total_mib']:>8} / {theirs['memory_total_mib']:<8}  "
                  f"{s['towerflow']['processes']} | {s['nvidia_smi']['processes']}")
    print(f"--watch 0.5 for 3 s, then SIGINT: rc {watched['returncode']}, {watched['frames']} frames")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_pid": load.pid, "samples": samples, "watch": watched}, f, indent=1)


if __name__ == "__main__":
    main()
