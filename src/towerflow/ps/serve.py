"""A ps task's whole program: `python -m towerflow.ps.serve [the seeds' flags]`.

`towerflow launch` runs this on every ps task, so a training script runs only on the chief and
the workers. The Server finds its task from the flags or from the launcher's environment; the
ps then serves the shards the chief creates (`ps/server/endpoints.py`: this task's `ServedModels`,
made here) until every task is done.
The program sits at the top of `ps/`, beside what it runs, so that its command stays
`towerflow.ps.serve`: the launcher, error messages and docs name it.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import torch

from towerflow import _files
from towerflow.cluster.server import Server
from towerflow.ps.server.endpoints import served_here
from towerflow.ps.server.monitor import PSRecorder
from towerflow.taskenv import TaskContext
from towerflow.ps.server.optimizers import warm_up
from towerflow.ps.server.publisher import Publisher, sink_for


def main(argv: Optional[Sequence[str]] = None, context: Optional[TaskContext] = None) -> None:
    """Serve this ps task's shards until every task of the cluster is done. `context`: this task's, when
    the entry point that runs it read it already (`strategy_from_env` on a scheduler's ps slot).

    `--import-path DIR` (the launcher passes the training script's folder) goes first on the
    import path, so functions a worker sends by reference to modules beside its script resolve here.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--import-path" in argv:
        at = argv.index("--import-path")
        if at + 1 >= len(argv):
            sys.exit("towerflow.ps.serve: --import-path needs a folder")
        sys.path.insert(0, argv[at + 1])
        del argv[at:at + 2]
    server = Server(argv=argv, context=context)
    if server.job_name != "ps":
        sys.exit(f"towerflow.ps.serve: {server.name} is not a ps task; run the training script on it")
    task = server.context
    if not task.tuning.threads_set_by_user:  # the ps shares the host's cores with the other local tasks, as workers do
        torch.set_num_threads(server.cluster.threads_per_local_task(os.cpu_count() or 1))
    served = served_here(server)
    warm_up()  # while the workers build their models
    logdir = task.tuning.logdir
    recorder = PSRecorder(logdir, f"ps:{server.task_index}", served.services,
                          restarts=task.identity.restart_count).start() if logdir else None
    publisher = None
    if task.ps.publish_every:
        target = task.ps.publish_to or os.path.join(logdir or ".", _files.PUBLISH_SUBDIR)
        publisher = Publisher(served.services, sink_for(target, server.task_index),
                              task.ps.publish_every, snapshot_every=task.ps.publish_snapshot_every,
                              task=server.name).start()
    try:
        server.join()
    finally:
        if publisher is not None:
            publisher.stop()  # one last publication: the rows of the last steps
        if recorder is not None:
            recorder.stop()


if __name__ == "__main__":
    main()
