"""How a task leaves: an uncaught exception becomes its recorded failure, and at exit it leaves its cluster.

The excepthook records and reports the failure (`failures.report`) before anything the other tasks depend on is let
go. The exit hook of a started Server then leaves the cluster: `abort` after a failure (the others must not wait
for this task), else `join`. A task that failed ends there with `os._exit`: the failure is recorded and reported,
nothing is left to save, and the interpreter's teardown with threads still inside torch and pyzmq (a store lost,
a link to a ps that went) was seen to crash the process (SIGSEGV, SIGABRT) after its clear error line, which the
launcher would then report instead.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Callable

from towerflow.cluster.membership import failures as _failures

_installed = False
_exit_at_once = False
_previous = sys.excepthook  # the hook that was there before towerflow's


def install(exit_at_once: bool = False) -> None:
    """Record and report an uncaught exception as this task's failure (`failures.report`).

    `exit_at_once`: then leave with os._exit(1) (all-reduce replicas: closing the connections
    fails the peers within seconds instead of at the collective's timeout). Calling it again puts
    the hook back on top: torch's process group wraps the excepthook in one that buffers stderr
    until the hook returns, which an os._exit would lose.
    """
    global _installed, _exit_at_once, _previous
    _exit_at_once = _exit_at_once or exit_at_once
    if _installed and sys.excepthook is _hook:
        return
    if not _installed:
        _previous = sys.excepthook
    _installed = True
    sys.excepthook = _hook


def _hook(exc_type, exc, tb):
    if issubclass(exc_type, KeyboardInterrupt) or exc is None:
        return _previous(exc_type, exc, tb)
    _failures.report(exc)
    if _exit_at_once:
        os._exit(1)


def leave_at_exit(store, abort: Callable[[str], None], join: Callable[[], None], task=None) -> None:
    """A started Server's exit hooks: failures go to its `store`, and at exit the task leaves the
    cluster with `abort` when a failure is recorded (an uncaught exception records one, see
    `install`), so that it does not wait on the others, then ends at once; else with `join`."""
    _failures.attach(store, task)
    install()

    def leave() -> None:
        failure = _failures.recorded()
        if failure is None:
            join()
            return
        try:
            abort(failure.error)
        finally:
            try:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(1)

    atexit.register(leave)
