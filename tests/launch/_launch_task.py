"""A task for launcher tests (no torch, so it starts fast): python _launch_task.py MODE DIR

env    print the environment contract as JSON
crash  record the pid; worker 1 exits 3 once every task has recorded its pid, the others sleep
flaky  print the launcher's id, then exit 5 unless the launcher has restarted this task
sleep  record the pid and sleep
"""

import json
import os
import sys
import time

mode, folder = sys.argv[1], sys.argv[2]
name = f"{os.environ['TOWERFLOW_JOB_NAME']}:{os.environ['TOWERFLOW_TASK_INDEX']}"
keys = ("TOWERFLOW_JOB_NAME", "TOWERFLOW_TASK_INDEX", "TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "TOWERFLOW_LOGDIR", "TOWERFLOW_DEVICE", "TOWERFLOW_CLUSTER_TOKEN", "TOWERFLOW_PS_MODE",
        "TOWERFLOW_PS_REPLICAS_TO_AGGREGATE", "TOWERFLOW_PS_STALENESS", "TOWERFLOW_LAUNCH_ID")
if mode == "env":
    print(json.dumps({k: os.environ.get(k) for k in keys}))
    print("to stderr", file=sys.stderr)
    sys.exit(0)
with open(os.path.join(folder, f"{name}.pid"), "w") as f:
    f.write(str(os.getpid()))
if mode == "crash" and name == "worker:1":
    n = json.loads(os.environ["TF_CONFIG"])["cluster"]
    total = sum(len(v) for v in n.values())
    deadline = time.time() + 30
    while len([p for p in os.listdir(folder) if p.endswith(".pid")]) < total and time.time() < deadline:
        time.sleep(0.05)
    print("worker 1 is about to fail", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "flaky":
    print("launch", os.environ.get("TOWERFLOW_LAUNCH_ID"), flush=True)
    sys.exit(0 if os.environ.get("TOWERFLOW_RESTART_COUNT") else 5)
time.sleep(120)
