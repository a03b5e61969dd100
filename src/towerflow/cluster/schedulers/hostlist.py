"""Slurm's compressed lists, expanded: hostlists (`node[01-04,07]`) and tasks per node (`3(x2),2,1`).

Pure functions over strings, in Slurm's order (no sorting, no de-duplication), so that the
n-th host is the node of the n-th block of ranks. Hosts are separated by commas or whitespace
outside brackets, as Slurm's own parser separates them (`hostlist_create`: tab, comma, space), so
a list set by hand (`alpha beta gamma`, or `scontrol show hostnames` one per line) is several hosts.
"""

from __future__ import annotations

import re
from typing import List

from towerflow.errors import SchedulerError

_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_hostlist(text: str) -> List[str]:
    """`rack1-node[1-2],login-x` (or `rack1-node[1-2] login-x`) -> ['rack1-node1', 'rack1-node2', 'login-x'];
    zero padding is kept."""
    hosts: List[str] = []
    for item in _split_top_level(text.strip(), text):
        hosts.extend(_expand_item(item, text))
    if not hosts:
        raise SchedulerError(f"empty Slurm hostlist {text!r}: expected e.g. 'node[01-04,07]', 'a,b,c' or 'a b c'")
    return hosts


def expand_tasks_per_node(text: str) -> List[int]:
    """`3(x2),2,1` -> [3, 3, 2, 1]: how many tasks each node of the hostlist runs, in its order."""
    counts: List[int] = []
    for part in (p.strip() for p in text.split(",")):
        m = _REPEAT.match(part)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise SchedulerError(f"bad Slurm tasks-per-node list {text!r} at {part!r}: expected counts like '3(x2),2,1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _split_top_level(text: str, whole: str) -> List[str]:
    """Split on the commas and whitespace outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SchedulerError(f"bad Slurm hostlist {whole!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SchedulerError(f"bad Slurm hostlist {whole!r}: ']' without '['")
        elif (ch == "," or ch.isspace()) and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise SchedulerError(f"bad Slurm hostlist {whole!r}: '[' without ']'")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_item(item: str, whole: str) -> List[str]:
    """One host or one `prefix[ranges]suffix` (several bracket groups multiply out, as in Slurm)."""
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_item(rest, whole) if rest else [""]
    return [f"{prefix}{number}{tail}" for number in _expand_ranges(ranges, whole) for tail in tails]


def _expand_ranges(ranges: str, whole: str) -> List[str]:
    numbers: List[str] = []
    for part in (p.strip() for p in ranges.split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise SchedulerError(f"bad Slurm hostlist {whole!r} at {part!r}: expected numbers or ranges like '01-04'")
        if not dash:
            numbers.append(lo)
            continue
        if int(hi) < int(lo):
            raise SchedulerError(f"bad Slurm hostlist {whole!r}: range {part!r} runs backwards")
        numbers.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))  # node[08-10]: width of '08' kept
    return numbers
