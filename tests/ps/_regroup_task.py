"""A worker that trains exactly BATCHES batches of its files, logging each batch's record ids:
python _regroup_task.py DIR DATA BATCHES LOGDIR

Records carry their id in column C1. Worker w appends a line per batch to DIR/ids-<w>.txt. With ps tasks the
chief waits for every worker before it leaves the session, so the checkpoint it writes at the end (in LOGDIR)
holds each worker's clock at BATCHES (all-reduce replicas step together: the end step is BATCHES). A run
restores the newest checkpoint of LOGDIR, with however many workers it has.
"""

import os
import sys

from _file_worker import setup, train_logged

import towerflow

folder, data, batches, logdir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

strategy = towerflow.strategy_from_env()
model, optimizer, stream = setup(strategy, data)
with open(os.path.join(folder, f"ids-{strategy.replica_id}.txt"), "w") as log, \
        towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, logdir=logdir, save_checkpoint_steps=10_000,
                                           save_checkpoint_secs=None, log_step_count_steps=0, progress=False) as session:
    for trained, batch in enumerate(stream, start=1):
        train_logged(session, model, optimizer, batch, log)
        if trained == batches:
            break
    if hasattr(strategy, "wait_for_workers") and strategy.is_chief:
        strategy.wait_for_workers()  # the end checkpoint then holds every worker's clock
    elif hasattr(strategy, "finish"):
        strategy.finish()
strategy.shutdown()
