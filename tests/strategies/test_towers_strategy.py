"""TowersStrategy: what MirroredStrategy gives for towers in one process, and the same training either way."""

import threading

import pytest
import torch

import towerflow
from _equivalence_worker import even
from towerflow.errors import StrategyError
from towerflow.strategies import TowersStrategy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _malloc_as_the_system_has_it(monkeypatch):
    # towers tune glibc malloc for their whole process; this pytest process runs other tests after these
    monkeypatch.setenv("TOWERFLOW_TOWERS_ALLOCATOR", "system")


@pytest.fixture
def made():
    strategies = []
    threads = torch.get_num_threads()
    yield strategies
    for s in strategies:
        s.shutdown()
    torch.set_num_threads(threads)
    assert not [t for t in threading.enumerate() if t.name.startswith("towerflow-tower")], "tower threads leaked"


@pytest.mark.parametrize("options", [{"towers": "threads"}, {}])  # asked for, or by the default rule
def test_mirrored_with_towers_is_a_towers_strategy(options, made):
    s = towerflow.MirroredStrategy(["/cpu:0", "/cpu:1"], **options)
    made.append(s)
    assert type(s) is TowersStrategy and isinstance(s, towerflow.MirroredStrategy)
    assert s.name == "mirrored" and s.towers == "threads" and s.num_replicas_in_sync == 2
    assert repr(s).startswith("MirroredStrategy(2 towers in one process on ")


def test_mirrored_with_processes_stays_mirrored(made):
    for options in ({"devices": ["/cpu:0"]}, {"devices": ["/cpu:1"], "towers": "processes"}):
        s = towerflow.MirroredStrategy(**options)
        made.append(s)
        assert type(s) is towerflow.MirroredStrategy and s.towers == "processes"


def test_towers_strategy_trains_as_mirrored_towers_and_one_replica(made):
    direct = TowersStrategy(devices=["/cpu:0", "/cpu:1"])
    mirrored = towerflow.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], towers="threads")
    made.extend([direct, mirrored])
    want = even(towerflow.OneDeviceStrategy("/cpu:0"), per_replica_batch=8)
    for got in (even(direct, per_replica_batch=4), even(mirrored, per_replica_batch=4)):
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-10)


def test_multi_worker_mirrored_refuses_towers():
    with pytest.raises(StrategyError, match="MirroredStrategy\\(towers='threads'\\)"):
        towerflow.MultiWorkerMirroredStrategy(devices=["/cpu:0", "/cpu:1"], towers="threads")
    with pytest.raises(StrategyError, match="use MirroredStrategy\\(towers='processes'\\)"):
        TowersStrategy(devices=["/cpu:0", "/cpu:1"], towers="processes")
