"""A ps worker training from its share of Parquet files, logging the records of every batch it trained:
python _files_task.py DIR DATA STEPS KILL_AT [LOGDIR]

Records carry their id in column C1 (table 0 is as large as the ids). Each incarnation of worker w appends
the ids of each batch it trained, a line per batch, to DIR/ids-<w>-<restart>.txt. Worker 1's first
incarnation, once KILL_AT batches are trained and logged, writes its pid to DIR/kill-me and waits to be
killed. The chief, after 10 steps, waits until worker 1's next incarnation has trained 3 batches, so the
run ends with both having read past the kill. KILL_AT 0: nobody is killed or waited for. LOGDIR: the chief
checkpoints there every 10 global steps (and at the end), and a run restores the newest checkpoint.
"""

import os
import sys
import time

from _file_worker import setup, train_logged

import towerflow

folder, data, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
logdir = sys.argv[5] if len(sys.argv) > 5 else None

def lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


strategy = towerflow.strategy_from_env()
worker, restart = strategy.replica_id, strategy.context.identity.restart_count
model, optimizer, stream = setup(strategy, data)
log = open(os.path.join(folder, f"ids-{worker}-{restart}.txt"), "a")
trained = 0
with towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, hooks=[towerflow.StopAtStepHook(last_step=steps)],
                                        logdir=logdir, save_checkpoint_steps=10 if logdir else None,
                                        save_checkpoint_secs=None, log_step_count_steps=0, progress=False) as session:
    for batch in stream:
        if session.should_stop():
            break
        train_logged(session, model, optimizer, batch, log)
        trained += 1
        time.sleep(0.02)
        if worker == 1 and restart == 0 and trained == kill_at:
            with open(os.path.join(folder, "kill-me.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(folder, "kill-me.tmp"), os.path.join(folder, "kill-me"))
            time.sleep(600)
        if strategy.is_chief and trained == 10 and kill_at:
            deadline = time.monotonic() + 90
            while lines(os.path.join(folder, "ids-1-1.txt")) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
strategy.shutdown()
