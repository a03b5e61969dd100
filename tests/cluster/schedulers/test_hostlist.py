"""Slurm's hostlists and tasks-per-node lists, expanded in Slurm's order."""

from __future__ import annotations

import re

import pytest

from towerflow.cluster.schedulers.hostlist import expand_hostlist, expand_tasks_per_node
from towerflow.cluster.schedulers.slurm import port_base
from towerflow.errors import SchedulerError


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("a,b,c", ["a", "b", "c"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[008-011]", ["node008", "node009", "node010", "node011"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("rack1-node[1-2],login-x", ["rack1-node1", "rack1-node2", "login-x"]),
        ("dgx-a100-[001-002],cpu7", ["dgx-a100-001", "dgx-a100-002", "cpu7"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("gpu[3],gpu[1]", ["gpu3", "gpu1"]),  # Slurm's order, not sorted
        ("n[1-2].cluster.local", ["n1.cluster.local", "n2.cluster.local"]),
        (" a , b ", ["a", "b"]),
    ],
)
def test_hostlists_expand_in_order_with_padding_kept(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("alpha beta gamma", ["alpha", "beta", "gamma"]),  # SLURM_NODELIST set by hand
        ("alpha\tbeta\n gamma\n", ["alpha", "beta", "gamma"]),  # `scontrol show hostnames` output, one per line
        ("alpha[1-3],beta", ["alpha1", "alpha2", "alpha3", "beta"]),
        ("alpha[1-3] beta", ["alpha1", "alpha2", "alpha3", "beta"]),
        ("n[1-2], login-x  cpu7", ["n1", "n2", "login-x", "cpu7"]),
        ("node[1, 3]", ["node1", "node3"]),  # whitespace inside brackets is not a separator
    ],
)
def test_whitespace_separates_hosts_as_in_slurms_own_parser(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, counts",
    [("1", [1]), ("4(x2)", [4, 4]), ("3(x2),2,1", [3, 3, 2, 1]), ("2,2(x3)", [2, 2, 2, 2]), ("8(x1)", [8])],
)
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: expand_hostlist(""), "empty Slurm hostlist ''"),
        (lambda: expand_hostlist(" \t "), "empty Slurm hostlist"),
        (lambda: expand_hostlist("node[01-"), "'[' without ']'"),
        (lambda: expand_hostlist("node01]"), "']' without '['"),
        (lambda: expand_hostlist("n[[1]]"), "nested '['"),
        (lambda: expand_hostlist("n[a-b]"), "at 'a-b': expected numbers or ranges like '01-04'"),
        (lambda: expand_hostlist("n[4-2]"), "range '4-2' runs backwards"),
        (lambda: expand_tasks_per_node("2(y2)"), "bad Slurm tasks-per-node list '2(y2)'"),
        (lambda: expand_tasks_per_node("0"), "at '0'"),
        (lambda: expand_tasks_per_node("2,"), "at ''"),
    ],
)
def test_bad_lists_are_named(call, message):
    with pytest.raises(SchedulerError, match=re.escape(message)):
        call()


def test_port_blocks_stay_in_range_and_differ_for_neighbouring_jobs_and_steps():
    bases = {port_base(job, step) for job in range(10000, 10625) for step in (0,)}
    assert len(bases) == 625 and min(bases) == 20000 and max(bases) + 63 == 59999
    assert port_base(12345, 0) != port_base(12346, 0) != port_base(12345, 1)
