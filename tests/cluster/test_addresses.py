"""Which address and interface a task uses, decided from its cluster entry and this machine's interfaces."""

from __future__ import annotations

import errno
import socket

import pytest

from towerflow.cluster import addresses
from towerflow.cluster.spec import ClusterSpec
from towerflow.errors import ClusterJoinError, ClusterSpecError

LOCAL = {"127.0.0.1": "lo", "::1": "lo", "10.1.0.5": "eth0", "fd00::5": "eth0"}


def test_a_cluster_all_on_loopback_stays_on_loopback():
    b = addresses.binding_for(ClusterSpec({"ps": ["localhost:2222"], "worker": ["127.0.0.1:2223"]}), "worker", 0, LOCAL)
    assert (b.host, b.port, b.interface, b.multi_host) == ("127.0.0.1", 2223, "lo", False)
    assert b.socket_environment() == {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_ipv6_loopback_binds_ipv6():
    b = addresses.binding_for(ClusterSpec({"worker": ["[::1]:2222", "[::1]:2223"]}), "worker", 1, LOCAL)
    assert (b.host, b.address, b.interface) == ("::1", "[::1]:2223", "lo")


@pytest.mark.parametrize("entry, host, interface", [("10.1.0.5:2222", "10.1.0.5", "eth0"),
                                                   ("[fd00::5]:2222", "fd00::5", "eth0")])
def test_an_address_of_this_machine_binds_its_interface(entry, host, interface):
    b = addresses.binding_for(ClusterSpec({"worker": [entry, "10.1.0.6:2222"]}), "worker", 0, LOCAL)
    assert (b.host, b.interface, b.multi_host) == (host, interface, True)


def test_an_address_no_interface_owns_is_refused_with_the_local_addresses_and_the_fix():
    with pytest.raises(ClusterSpecError) as e:
        addresses.binding_for(ClusterSpec({"worker": ["10.1.0.5:2222", "10.1.0.6:2222"]}), "worker", 1, LOCAL)
    text = str(e.value)
    assert "/job:worker/task:1 is at '10.1.0.6:2222'" in text
    assert "eth0 10.1.0.5" in text and "lo 127.0.0.1" in text
    assert "Start /job:worker/task:1 on the machine that owns" in text


def test_a_literal_loopback_entry_beside_other_hosts_is_refused():
    with pytest.raises(ClusterSpecError, match="loopback address, but the cluster has tasks on other hosts"):
        addresses.binding_for(ClusterSpec({"ps": ["localhost:2222"], "worker": ["10.1.0.6:2222"]}), "ps", 0, LOCAL)


def test_a_hostname_mapped_to_loopback_binds_the_address_that_reaches_the_other_hosts(monkeypatch):
    """Debian's /etc/hosts maps the machine's own name to 127.0.x.1; its peers know it by its real address."""
    names = {"me": ["127.0.1.1"], "other": ["10.1.0.6"]}
    monkeypatch.setattr(addresses, "resolve", lambda host, where="": names.get(host) or [host])
    monkeypatch.setattr(addresses, "route_source", lambda ip: "10.1.0.5")
    cluster = ClusterSpec({"ps": ["me:2222"], "worker": ["other:2222"]})
    b = addresses.binding_for(cluster, "ps", 0, LOCAL)
    assert (b.host, b.interface, b.multi_host) == ("10.1.0.5", "eth0", True)
    assert addresses.dial_host(cluster, "me", LOCAL) == "10.1.0.5"  # a task on this machine dials the same place
    assert addresses.dial_host(cluster, "other", LOCAL) == "10.1.0.6"


def test_a_host_whose_network_is_down_says_so_instead_of_a_socket_traceback(monkeypatch):
    """A host cut off from the others (its link down) learns it as it starts a task, in words."""
    class Unreachable(socket.socket):
        def connect(self, address):
            raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(addresses.socket, "socket", Unreachable)
    with pytest.raises(ClusterJoinError) as e:
        addresses.route_source("10.1.0.6")
    text = str(e.value)
    assert "has no route to 10.1.0.6" in text and "Network is unreachable" in text
    assert "check that its network is up" in text


def test_an_unresolvable_host_names_the_task():
    with pytest.raises(ClusterSpecError, match=r"cannot resolve host 'no-such-host\.invalid' \(/job:worker/task:0\)"):
        addresses.binding_for(ClusterSpec({"worker": ["no-such-host.invalid:2222"]}), "worker", 0, LOCAL)


def test_the_launcher_hands_the_interface_to_the_task_unless_the_user_chose_one(tmp_path, monkeypatch):
    from towerflow.launch.local import plan_one

    spec = tmp_path / "cluster.json"
    spec.write_text('{"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}')
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    env = plan_one(["x.py"], str(spec), "worker", 1).tasks[0].env
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["TP_SOCKET_IFNAME"] == "lo"
    assert "NCCL_SOCKET_IFNAME" not in env  # the user's own choice is inherited as it is
    assert env["MASTER_ADDR"] == "127.0.0.1"
