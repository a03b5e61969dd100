"""A task that joins the cluster and serves: python _serve.py CLUSTER_JSON JOB INDEX [busy]

With 'busy' it works (sleeps) for a minute before joining, so a test can kill it mid-work;
with 'fail' it raises instead of joining.
"""

import json
import sys
import time

import towerflow

server = towerflow.Server(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
print("UP", flush=True)
if sys.argv[4:] == ["busy"]:
    time.sleep(60)
if sys.argv[4:] == ["fail"]:
    raise RuntimeError("task broke on purpose")
server.join()
