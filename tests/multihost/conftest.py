"""The `hosts` fixture: separate machines as network namespaces (tests/multihost/netns.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "ps"))  # _launch: the embedded cluster, for comparisons

from netns import Hosts, unavailable  # noqa: E402

_why_not = unavailable()


@pytest.fixture
def hosts(tmp_path, request):
    """hosts(n): n hosts on one bridge; everything started on them is killed and they are removed after."""
    if _why_not:
        pytest.skip(f"multi-host tests: {_why_not}")
    made = []

    def make(n: int) -> Hosts:
        h = Hosts(n, tmp_path)
        made.append(h)
        return h

    yield make
    report = getattr(request.node, "rep_call", None)
    for h in made:
        if report is not None and report.failed:
            for p in h.procs:
                print(f"--- {p.log.name} on {p.host.name} ---\n{p.output[-5000:]}")
        h.close()
