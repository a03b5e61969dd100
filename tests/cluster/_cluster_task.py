"""One task of the test cluster: worker 0 is the client that checks remote execution; the rest serve.

    python _cluster_task.py CLUSTER_JSON JOB INDEX
Prints 'CHECK <name> ok' per passed check; any failed assertion exits non-zero.
"""

import json
import os
import sys
import time

import torch

import towerflow


@towerflow.function
def whoami(x):
    return towerflow.Server.local_name(), os.getpid(), x


@towerflow.function
def scale(t: torch.Tensor, by: float) -> dict:
    return {"out": t * by, "device": str(t.device), "where": towerflow.Server.local_name()}


@towerflow.function
def placed() -> str:
    return str(torch.zeros(1).device)  # a factory: the device scope sent with the call places it


@towerflow.function
def explode(why: str):
    raise ValueError(f"bad input {why!r}")


def client(server: towerflow.Server) -> None:
    pids = set()
    for task in server.cluster.tasks():
        with towerflow.device(task):
            name, pid, echo = whoami(41)
        assert name == f"/job:{task.job}/task:{task.task}" and echo == 41, (name, echo)
        pids.add(pid)
    assert len(pids) == 3, pids
    print("CHECK values ok", flush=True)

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    futures = []
    for task in server.cluster.tasks():
        with towerflow.device(task):
            futures.append(scale.remote(t, 2.0))
    for task, f in zip(server.cluster.tasks(), futures):
        got = f.result()
        assert torch.equal(got["out"], t * 2.0) and got["where"] == f"/job:{task.job}/task:{task.task}", got
    big = torch.randn(1 << 20)  # 4 MB each way
    back = towerflow.remote(scale, big, 1.0, device="/job:ps/task:0").result()
    assert torch.equal(back["out"], big)
    print("CHECK tensors ok", flush=True)

    with towerflow.device("/job:worker/task:1/device:CPU:0"):
        assert placed() == "cpu"
    print("CHECK device part ok", flush=True)

    try:
        with towerflow.device("/job:worker/task:1"):
            explode("x")
    except ValueError as e:
        assert "bad input 'x'" in str(e), e
        cause = str(e.__cause__)
        assert "/job:worker/task:1" in cause and "in explode" in cause and "ValueError" in cause, cause
        print("CHECK remote exception ok", flush=True)
    else:
        raise AssertionError("the remote ValueError did not surface")

    towerflow.configure(log_device_placement=True)
    with towerflow.device("/job:ps/task:0"):
        whoami(1)
    towerflow.configure(log_device_placement=False)
    lines = [r.line() for r in towerflow.placement_log()]
    assert any("/job:ps/replica:0/task:0" in l and "RemoteCall" in l for l in lines), lines
    print("CHECK placement log ok", flush=True)

    # an idle task must not burn a core: no thread of the messaging layer polls
    before = time.process_time()
    time.sleep(1.0)
    idle = time.process_time() - before
    assert idle < 0.3, f"{idle:.2f} s of CPU in 1 s of idling"
    print("CHECK idle ok", flush=True)


def main() -> None:
    cluster, job, index = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    server = towerflow.Server(cluster, job, index, join_timeout=60)
    print(f"UP {server.name} {server.target}", flush=True)
    if (job, index) == ("worker", 0):
        client(server)
    server.join()
    print(f"DONE {server.name}", flush=True)


if __name__ == "__main__":
    main()
