"""The launcher's verdict on a failed run: the task whose own code failed first, its traceback
once, and one line for each task that stopped because of it.

Each task that fails leaves a `FailureReport` in its TOWERFLOW_ERROR_FILE (cluster/membership/failures.py):
its own record and the cluster's first failure as the store numbered them. The first failure is
the own failure with the lowest number, so the verdict follows causes, not the order in which
processes happened to exit; in a one-task-per-host launch the local task's report names a remote
first failure too. A task that left no report (killed by a signal, or a program that does not use
towerflow) is judged by its exit, as before.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from towerflow.cluster.membership.failures import FailureRecord, FailureReport

PREFIX = "towerflow launch: "  # every line the launcher says starts so
# libtorch's warning header: "[W1123 17:51:07.418216393 file.cpp:125] ", with "[rankN]:" before it once
# a process group is up
_WARNING = r"^(\[rank\d+\]:)?\[W\S* [^\]]*"

# c10d's warning when a store call finds its connection gone (a peer that hosted a store died),
# followed by the C++ stack it prints with it: the lines _TRACE matches. Every peer of a failed task
# prints it as the failure's connections close; the supervisor leaves it out once it knows of a
# failure (see Supervisor._failing). ZeroMQ, the messaging layer, prints nothing of the kind.
_STORE_NOISE = re.compile(
    _WARNING + r"(TCPStore|socket|Utils)\.(cpp|hpp):\d+\] \[c10d\] .*(Connection reset by peer|Connection closed "
    r"by peer|Broken pipe|recvValue failed|failed to recv)"
)
_TRACE = re.compile(r"^(Exception raised from \S+ at |frame #\d+: |<omitting python frames>$|$)")


def is_transport_noise(line: str) -> bool:
    """Whether a task's stderr line is the store's warning about a connection that closed."""
    return _STORE_NOISE.match(line) is not None


def continues_noise(line: str) -> bool:
    """Whether a line after such a warning is the C++ stack printed with it (held with the warning)."""
    return _TRACE.match(line) is not None


@dataclasses.dataclass(frozen=True)
class TaskEnd:
    """How the last process of one task ended, as the supervisor saw it."""

    name: str
    pid: int
    exit_code: Optional[int]
    stopped: bool  # the launcher stopped it (after the first failure)
    report_path: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the launcher says about a failed run, and the exit code it returns."""

    task: str  # the task that failed first
    text: str
    exit_code: int
    first: Optional[FailureRecord] = None  # its record, when it left one


def _how(code: Optional[int], stopped: bool = False) -> str:
    if stopped:
        return "then stopped by the launcher"
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _exit_code(code: int) -> int:
    return code if 0 < code < 256 else 128 + (-code if code < 0 else 1)


def read_report(path: str) -> Tuple[Optional[FailureReport], Optional[str]]:
    """A task's report, or None when it left none; the second item says why one could not be read."""
    if not os.path.exists(path):
        return None, None
    try:
        return FailureReport.read(path), None
    except (OSError, ValueError, TypeError, KeyError) as e:
        return None, f"its failure report {path} is unreadable ({e})"


def _first_failure(reports: Dict[str, FailureReport]) -> Tuple[Optional[FailureRecord], str]:
    """The own failure the store numbered first, from the tasks' records and what they read of the others."""
    seen = [r.failure for r in reports.values() if r.failure.is_own] + [r.first for r in reports.values() if r.first]
    numbered = [r for r in seen if r.seq is not None]
    if numbered:
        return min(numbered, key=lambda r: r.seq), ""
    if seen:
        return min(seen, key=lambda r: r.time), " (by time: no store numbered the failures)"
    return None, ""


def decide(ends: Sequence[TaskEnd], first_exit: TaskEnd, host: str, dropped: int = 0) -> Verdict:
    """The verdict on a run that failed; `first_exit` is the failed process the supervisor saw first."""
    reports: Dict[str, FailureReport] = {}
    lines: List[str] = []
    for end in ends:
        report, problem = read_report(end.report_path)
        if report is not None:
            reports[end.name] = report
        if problem:
            lines.append(f"{end.name}: {problem}")
    first, how_ordered = _first_failure(reports)
    ours = {e.name: e for e in ends}
    if first is not None and first.task in ours:
        end = ours[first.task]
        code = end.exit_code if not end.stopped and end.exit_code else first_exit.exit_code
        how = "the launcher stopped it as it shut down" if end.stopped else _how(end.exit_code)
        head = f"{first.task} (pid {first.pid} on {first.host}) failed first{how_ordered} ({how}):"
        body = first.traceback.rstrip() or first.error
        text = head + "\n  " + "\n  ".join(body.splitlines())
        name = first.task
    elif first is not None:  # another host's task: its own launcher prints its traceback
        code = first_exit.exit_code
        text = (f"{first.task} (pid {first.pid} on {first.host}) failed first{how_ordered}: {first.error}\n"
                f"  (its traceback is in the launch output on {first.host})")
        name = first.task
    elif first_exit.name in reports:  # no task's own error: this one stopped for another (missing, lost) one
        end, failure = first_exit, reports[first_exit.name].failure
        code = end.exit_code
        text = f"{end.name} (pid {end.pid} on {host}) stopped first ({_how(code)}): {failure.error}"
        name = end.name
    else:
        end = first_exit
        code = end.exit_code
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        text = (f"{end.name} (pid {end.pid} on {host}) failed first: it {how}. It recorded no error "
                "(not an exception towerflow saw); its own output above says why.")
        name = end.name
    stopped = []
    for end in ends:
        if end.name == name or end.exit_code == 0:
            continue
        report = reports.get(end.name)
        if report is not None and not report.failure.is_own:
            lines.append(f"{end.name} stopped because of it ({_how(end.exit_code, end.stopped)}).")
        elif report is not None:
            same = first is not None and report.failure.error == first.error
            lines.append(f"{end.name} also failed on its own ({_how(end.exit_code, end.stopped)}): "
                         f"{'the same error' if same else report.failure.error}")
        elif end.stopped:
            stopped.append(end.name)
        else:
            lines.append(f"{end.name} {_how(end.exit_code)}; it recorded no error (its output above says why).")
    if stopped:
        lines.append(f"stopped the other {len(stopped)} running task(s): {', '.join(stopped)}.")
    if dropped:
        lines.append(f"left out {dropped} transport warning(s) about connections that closed after the failure.")
    text = "\n".join(PREFIX + block for block in [text] + lines)
    return Verdict(name, text, _exit_code(code if code else 1), first)


def restart_note(path: str) -> str:
    """What a restarted task's failure was, for the supervisor's restart message ('' without a report)."""
    report, problem = read_report(path)
    if report is None:
        return f" ({problem})" if problem else ""
    failure = report.failure
    if not failure.is_own:
        return f"; it {failure.summary}"
    return ". It failed:\n  " + "\n  ".join((failure.traceback.rstrip() or failure.error).splitlines())
