"""A task that joins the cluster and serves until the test kills it: python _serve.py CLUSTER_JSON JOB INDEX"""

import json
import sys

import towerflow

server = towerflow.Server(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
server.join()
