"""Where the cluster's store is: `--store` / TOWERFLOW_STORE as etcd URLs, parsed once, refused with the value,
the expected form and an example; a launch with one hands it to every task and hosts nothing itself."""

from __future__ import annotations

import pytest

from towerflow import etcd_url, taskenv
from towerflow.errors import TowerflowError
from towerflow.launch.config import LaunchConfig
from towerflow.launch.planning import plan_launch


@pytest.mark.parametrize("url, endpoints, prefix", [
    ("etcd://h1:2379,h2:2379,h3:2379", (("h1", 2379), ("h2", 2379), ("h3", 2379)), None),
    ("etcd://10.0.0.1", (("10.0.0.1", 2379),), None),
    ("etcd://[fd00::1]:2380,h2/runs/7", (("fd00::1", 2380), ("h2", 2379)), "runs/7"),
])
def test_an_etcd_url_names_its_members_and_the_run_s_prefix(url, endpoints, prefix):
    address = etcd_url.parse_etcd_url(url, "--store")
    assert (address.endpoints, address.prefix) == (endpoints, prefix)
    assert etcd_url.parse_etcd_url(address.url(), "--store") == address


@pytest.mark.parametrize("url, problem", [
    ("h1:2379", "no etcd:// scheme"),
    ("http://h1:2379", "'http://' is not a store towerflow knows"),
    ("etcd://h1:x", "the port of 'h1:x' is not a number"),
    ("etcd://", "'' is not HOST or HOST:PORT"),
    ("etcd://fd00::1", "an IPv6 address goes in brackets"),
    ("etcd://h1,h1:2379", "a member is named twice"),
])
def test_a_bad_url_is_refused_with_the_value_the_form_and_an_example(url, problem):
    with pytest.raises(taskenv.TaskEnvironmentError) as e:
        etcd_url.parse_etcd_url(url, "--store")
    text = str(e.value)
    assert f"--store={url!r}" in text and problem in text
    assert "expected etcd://HOST[:PORT]" in text and "e.g. etcd://h1:2379,h2:2379,h3:2379" in text


def test_the_task_environment_refuses_a_bad_store_naming_the_variable():
    with pytest.raises(taskenv.TaskEnvironmentError, match="TOWERFLOW_STORE='etcd://h1:0'"):
        taskenv.read({"TOWERFLOW_STORE": "etcd://h1:0"})
    assert taskenv.read({"TOWERFLOW_STORE": "127.0.0.1:4000"}).join.store == "127.0.0.1:4000"  # the launcher's own


def test_a_launch_with_store_hands_it_to_every_task_and_hosts_no_store(launch_script):
    plan = plan_launch(LaunchConfig(script=launch_script, ps=1, workers=2, store="etcd://h1,h2:2381/run"))
    try:
        assert plan.store_address is None  # nothing for the launcher to host
        assert {t.env["TOWERFLOW_STORE"] for t in plan.tasks} == {"etcd://h1:2379,h2:2381/run"}
    finally:
        plan.release()


def test_a_launch_with_a_bad_store_is_refused_before_anything_starts(launch_script):
    with pytest.raises(TowerflowError, match=r"--store='redis://h1': .*expected etcd://"):
        plan_launch(LaunchConfig(script=launch_script, workers=1, store="redis://h1"))
