"""The cluster's store in a real etcd (cluster/store/etcd_store.py) on loopback: c10d's semantics, gloo
over it, a lost member, no member at all, the run's keys expiring, a task restarted after they did,
and a launch that uses it."""

from __future__ import annotations

import datetime
import json
import time
import uuid

import pytest
import torch.distributed as dist

from _cluster_procs import wait_until
from _etcd import LocalEtcd, unavailable

pytestmark = pytest.mark.timeout(120)

GLOO_TASK = """
import sys
import torch, torch.distributed as dist
from towerflow.cluster.store.etcd_store import EtcdStore
rank, port, prefix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.PrefixStore("group", EtcdStore([("127.0.0.1", port)], prefix, timeout=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
print("sum", x.item(), flush=True)
dist.destroy_process_group()
"""

# A task of a two-task cluster, as a launcher starts it (its env says the store, the launch and the restart);
# "hold": it never finishes, so its run never ends
TASK = """
import json, sys, time
import towerflow
server = towerflow.Server(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
print("up", flush=True)
if sys.argv[4] == "hold":
    time.sleep(600)
server.join()
print("finished", flush=True)
"""


@pytest.fixture
def etcd(free_ports):
    if unavailable():
        pytest.skip(unavailable())
    made = []

    def make(n: int = 1) -> LocalEtcd:
        made.append(LocalEtcd(n, free_ports(2 * n)))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def _store(cluster, **kwargs):
    from towerflow.cluster.store.etcd_store import EtcdStore

    return EtcdStore(cluster.endpoints, f"test/{uuid.uuid4().hex}", timeout=kwargs.pop("timeout", 2), **kwargs)


def _script(store) -> list:
    """The same calls on any c10d store, and what each returned."""
    out = [store.compare_set("a", "", "x"), store.compare_set("a", "", "y"), store.compare_set("a", "x", "z"),
           store.compare_set("b", "q", "z"), store.check(["b"])]
    store.set("e", b"")
    out += [store.compare_set("e", "", "w"), store.add("c", 1), store.add("c", 2), store.add("c", 0),
            store.check(["a", "c"]), store.check(["a", "nope"]), store.multi_get(["a", "c"]),
            store.delete_key("a"), store.delete_key("a"), store.check(["a"]), store.get("c")]
    for wait in (lambda: store.get("never"), lambda: store.wait(["never"], datetime.timedelta(seconds=0.3))):
        with pytest.raises(dist.DistStoreError):
            wait()
    return out


def test_it_answers_every_call_as_the_tcpstore_does(etcd, free_ports):
    cluster = etcd(1)
    port = free_ports(1)[0]
    tcp = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=2), wait_for_workers=False)
    expected = _script(tcp)
    assert _script(_store(cluster)) == expected
    assert _script(dist.PrefixStore("towerflow", _store(cluster))) == expected  # c10d's C++ calling into Python


def test_a_batch_of_more_keys_than_a_transaction_holds_is_read_in_parts(etcd):
    """etcd refuses a transaction of more than 128 operations; a check of every task's beat and incarnation names
    2N keys (and a wait for all slots N): 300 keys are checked, read and written in parts."""
    store = _store(etcd(1))
    keys = [f"beat/worker/{i}" for i in range(300)]
    store.multi_set(keys, [str(i) for i in range(300)])
    assert store.check(keys) and not store.check(keys + ["nope"])
    assert store.multi_get(keys) == [str(i).encode() for i in range(300)]


def test_gloo_forms_a_process_group_over_it(etcd, procs):
    cluster = etcd(1)
    prefix = f"test/{uuid.uuid4().hex}"
    ranks = [procs.python("-c", GLOO_TASK, str(r), str(cluster.endpoints[0][1]), prefix) for r in range(2)]
    for p in ranks:
        assert p.wait(60) == 0, p.describe()
        assert "sum 3.0" in p.out


def test_a_lost_member_costs_a_call_one_reconnect(etcd):
    cluster = etcd(3)
    store = _store(cluster)
    store.set("k", "1")
    member = store.client._preferred  # the member every call goes to now
    cluster.kill(member)
    start = time.monotonic()
    assert store.add("beat", 1) == 1 and store.get("k") == b"1"  # a majority (2 of 3) still serves
    assert time.monotonic() - start < 6.0
    assert store.client._preferred != member


def test_an_add_that_etcd_applied_but_whose_reply_was_lost_is_not_applied_again(etcd):
    store = _store(etcd(1))
    store.add("failures/count", 1)
    post, lost = store.client._post, []

    def applied_then_lost(i, path, data, end):
        reply = post(i, path, data, end)
        if path.endswith("/kv/txn") and not lost:
            lost.append(path)
            raise ConnectionResetError("the member went away before it answered")
        return reply

    store.client._post = applied_then_lost
    assert store.add("failures/count", 1) == 2 and lost  # retried, found its own mark
    assert store.add("failures/count", 0) == 2 and store.num_keys() == 1


def test_no_member_answering_is_a_bounded_named_error(free_ports):
    from towerflow.cluster.store.etcd import EtcdUnavailable
    from towerflow.cluster.store.etcd_store import EtcdStore

    ports = free_ports(2)
    start = time.monotonic()
    with pytest.raises(EtcdUnavailable) as e:
        EtcdStore([("127.0.0.1", p) for p in ports], "test/none", timeout=1, reach_within=1.5)
    assert time.monotonic() - start < 4.0
    assert all(f"127.0.0.1:{p}" in str(e.value) for p in ports) and "within 1.5 s" in str(e.value)


def test_a_run_s_keys_expire_once_its_last_process_lets_go(etcd, monkeypatch):
    from towerflow.cluster.store import etcd_store

    monkeypatch.setattr(etcd_store, "LEASE_TTL", 2)
    cluster = etcd(1)
    first = _store(cluster)
    first.set("slot/worker/0", "held")
    again = etcd_store.EtcdStore(cluster.endpoints, first.prefix.decode(), timeout=1)
    assert again.lease == first.lease and again.check(["slot/worker/0"])  # a second process shares the run's lease
    first.close()
    again.close()
    wait_until(lambda: not again.check(["slot/worker/0"]), 20, "the run's keys to expire")
    fresh = etcd_store.EtcdStore(cluster.endpoints, first.prefix.decode(), timeout=1)
    assert fresh.lease != first.lease and fresh.num_keys() == 0


@pytest.mark.multiprocess
def test_a_launch_with_store_meets_in_etcd_and_the_launcher_hosts_nothing(etcd, procs):
    cluster = etcd(3)
    url = cluster.url + "/hello-" + uuid.uuid4().hex[:8]
    run = procs.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--store", url,
                       "examples/hello_cluster.py", label="launch")
    assert run.wait(90) == 0, run.describe()
    assert run.out.count("Hello, this is") == 3
    from towerflow.cluster.store.etcd_store import EtcdStore
    from towerflow.etcd_url import parse_etcd_url

    seen = EtcdStore(cluster.endpoints, "towerflow/" + parse_etcd_url(url, "url").prefix, timeout=1)
    assert seen.check(["towerflow/coordinator", "towerflow/slot/ps/0", "towerflow/cluster/end"])


def test_a_task_whose_etcd_is_unreachable_fails_within_its_join_timeout(free_ports, monkeypatch):
    import towerflow
    from towerflow.devices.logical import set_local_task
    from towerflow.errors import ClusterJoinError

    for name in ("TOWERFLOW_JOB_NAME", "TOWERFLOW_TASK_INDEX", "TP_SOCKET_IFNAME"):  # a Server makes this process
        monkeypatch.setenv(name, "x")  # its task; monkeypatch unsets them again after
        monkeypatch.delenv(name)
    store_port, task_port = free_ports(2)
    monkeypatch.setenv("TOWERFLOW_STORE", f"etcd://127.0.0.1:{store_port}")
    start = time.monotonic()
    with pytest.raises(ClusterJoinError) as e:
        towerflow.Server({"worker": [f"127.0.0.1:{task_port}"]}, "worker", 0, join_timeout=2)
    assert time.monotonic() - start < 5.0
    assert f"etcd at 'etcd://127.0.0.1:{store_port}'" in str(e.value) and "TOWERFLOW_STORE" in str(e.value)
    set_local_task("localhost", 0)


def _run_task(procs, spec: dict, job: str, url: str, launch: str, restart: int, hold: bool = False):
    env = {"TOWERFLOW_STORE": url, "TOWERFLOW_LAUNCH_ID": launch, "TOWERFLOW_RESTART_COUNT": str(restart),
           "TOWERFLOW_MAX_RESTARTS": "3", "TOWERFLOW_JOIN_TIMEOUT": "4"}
    return procs.python("-c", TASK, json.dumps(spec), job, "0", "hold" if hold else "go", env=env,
                        label=f"{job}-{launch}-{restart}")


def _expire_run(cluster, url: str) -> None:
    """What etcd does LEASE_TTL s after a run's last process is gone, at once: the run's keys leave."""
    from towerflow.cluster.store.etcd_store import EtcdStore
    from towerflow.etcd_url import parse_etcd_url

    run = EtcdStore(cluster.endpoints, "towerflow/" + parse_etcd_url(url, "url").prefix, timeout=1)
    run.close()
    run.client.revoke(run.lease)
    assert not run.check(["towerflow/coordinator"])


@pytest.mark.multiprocess
def test_a_task_restarted_after_its_run_ended_and_left_the_store_exits_0(etcd, procs, free_ports):
    cluster = etcd(1)
    spec = {"ps": [f"127.0.0.1:{p}" for p in free_ports(1)], "worker": [f"127.0.0.1:{p}" for p in free_ports(1)]}
    url = cluster.url + "/ended-" + uuid.uuid4().hex[:8]
    first = [_run_task(procs, spec, job, url, "launch-a", 0) for job in ("ps", "worker")]
    for p in first:
        assert p.wait(60) == 0, procs.describe()
    _expire_run(cluster, url)
    # the worker's host was cut off across the job's end: its launcher restarts it once the cable is back
    again = _run_task(procs, spec, "worker", url, "launch-a", 1)
    assert again.wait(30) == 0, again.describe()
    assert "has nothing to rejoin: its cluster's run ended" in again.err and "up" not in again.out


@pytest.mark.multiprocess
def test_a_task_restarted_after_its_run_left_the_store_unended_does_not_exit_0(etcd, procs, free_ports):
    cluster = etcd(1)
    spec = {"ps": [f"127.0.0.1:{p}" for p in free_ports(1)], "worker": [f"127.0.0.1:{p}" for p in free_ports(1)]}
    url = cluster.url + "/unended-" + uuid.uuid4().hex[:8]
    first = [_run_task(procs, spec, job, url, "launch-b", 0, hold=True) for job in ("ps", "worker")]
    wait_until(lambda: all("up" in p.out for p in first), 60, "both tasks up")
    for p in first:
        p.kill_group()
    _expire_run(cluster, url)
    again = _run_task(procs, spec, "worker", url, "launch-b", 1)
    assert again.wait(30) != 0, again.describe()
    assert "gone from the store without an end" in again.err and "missing: /job:ps/task:0" in again.err, again.describe()
