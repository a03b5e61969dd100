"""A task that joins the cluster and serves: python _serve.py CLUSTER_JSON JOB INDEX [busy|fail|call FILE]

With 'busy' it works (sleeps) for a minute before joining, so a test can kill it mid-work;
with 'fail' it raises instead of joining; with 'call FILE' it waits for FILE to appear, then
calls a function on worker 1 and prints how that call ended.
"""

import json
import os
import sys
import time

import towerflow

server = towerflow.Server(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
print("UP", flush=True)
if sys.argv[4:] == ["busy"]:
    time.sleep(60)
if sys.argv[4:] == ["fail"]:
    raise RuntimeError("task broke on purpose")
if sys.argv[4:5] == ["call"]:
    while not os.path.exists(sys.argv[5]):
        time.sleep(0.05)
    start = time.monotonic()
    try:
        towerflow.remote(time.time, device="/job:worker/task:1").result()
        print("CALL RETURNED", flush=True)
    except towerflow.ClusterError as e:
        print(f"CALL FAILED after {time.monotonic() - start:.1f} s: {e}", flush=True)
    os._exit(0)
server.join()
