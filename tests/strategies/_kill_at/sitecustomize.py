"""Stops a task of an unchanged training script at a chosen moment, for a test to kill it there.

A test puts this folder first on PYTHONPATH and sets KILL_AT and KILL_DIR; Python imports this module
at start-up in every process of the launch (the launcher's fork server too, whose tasks inherit the
patches). The first incarnation of one task then stops, writes "PID GLOBAL_STEP" to KILL_DIR/kill-me and
waits 60 s to be killed:

    KILL_AT=backward     worker 1, inside the backward pass of its 12th step (a gradient hook on its first
                         dense parameter, while DDP all-reduces the buckets already done)
    KILL_AT=checkpoint   the chief, inside the write of its step-80 checkpoint, the file half written
"""

import contextlib
import os
import sys
import time

_MOMENT = os.environ.get("KILL_AT")


def _first_incarnation(rank: str) -> bool:
    return os.environ.get("TOWERFLOW_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == rank


def _wait_to_be_killed(step) -> None:
    folder = os.environ["KILL_DIR"]
    with open(os.path.join(folder, "kill-me.tmp"), "w") as marker:
        marker.write(f"{os.getpid()} {step}")
    os.replace(os.path.join(folder, "kill-me.tmp"), os.path.join(folder, "kill-me"))
    time.sleep(60)
    sys.exit("sitecustomize: nobody killed this task where it waited within 60 s")


def _stop_in_backward() -> None:
    from torch.nn.parallel import DistributedDataParallel

    built = DistributedDataParallel.__init__

    def __init__(self, module, *args, **kwargs):
        built(self, module, *args, **kwargs)
        if not _first_incarnation("1"):
            return
        calls = []

        def in_backward(grad):
            calls.append(1)
            if len(calls) == 12:
                _wait_to_be_killed(f"backward-{len(calls)}")
            return grad

        ignored = getattr(self, "parameters_to_ignore", set())  # the ps tables' stand-ins: not all-reduced
        next(p for name, p in module.named_parameters() if p.requires_grad and name not in ignored
             ).register_hook(in_backward)

    DistributedDataParallel.__init__ = __init__


def _stop_in_checkpoint() -> None:
    from towerflow.session import checkpoint

    real_write = checkpoint.atomic_write

    @contextlib.contextmanager
    def held_write(path, mode="wb"):
        with real_write(path, mode) as f:
            yield f
            if os.path.basename(path) == "ckpt-0000000080.pt" and _first_incarnation("0"):
                f.flush()
                _wait_to_be_killed(80)

    checkpoint.atomic_write = held_write


if _MOMENT == "backward":
    _stop_in_backward()
elif _MOMENT == "checkpoint":
    _stop_in_checkpoint()
