"""ClusterSpec from every format, TF's methods, and an error naming the bad entry for every bad input."""

from __future__ import annotations

import json
import pickle

import pytest

from towerflow import ClusterSpec, ClusterSpecError
from towerflow.cluster.spec import parse_flags, split_address

CLUSTER = {"ps": ["localhost:2222"], "worker": ["localhost:2223", "localhost:2224"]}


def test_from_dict_has_tf_methods():
    c = ClusterSpec(CLUSTER)
    assert c.jobs == ["worker", "ps"]  # rank order: chief, workers, ps
    assert c.num_tasks("worker") == 2 and c.num_tasks("ps") == 1
    assert c.task_address("worker", 1) == "localhost:2224"
    assert c.task_indices("worker") == [0, 1]
    assert c.as_dict() == {"worker": ["localhost:2223", "localhost:2224"], "ps": ["localhost:2222"]}
    assert [str(t) for t in c.tasks()] == ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1", "/job:ps/replica:0/task:0"]
    assert ClusterSpec(c) == c and ClusterSpec({"worker": "localhost:2223,localhost:2224", "ps": ["localhost:2222"]}) == c


def test_chief_comes_first_and_replicas_exclude_ps():
    c = ClusterSpec({"ps": ["h:1"], "worker": ["h:2"], "chief": ["h:3"]})
    assert str(c.coordinator()) == "/job:chief/replica:0/task:0"
    assert [t.job for t in c.replicas()] == ["chief", "worker"]


def test_sparse_dict_form_with_contiguous_indices():
    assert ClusterSpec({"worker": {1: "h:2", 0: "h:1"}}).job_tasks("worker") == ["h:1", "h:2"]


# TensorFlow's semantics. These replaced three assertions that contradicted TF: ClusterSpec({}) and a
# job with no tasks used to be refused, sparse indices too; TF accepts all three (server_lib.ClusterSpec).
def test_an_empty_spec_is_falsy_and_a_job_may_have_no_tasks():
    empty = ClusterSpec({})
    assert not empty and empty.jobs == [] and empty.as_dict() == {} and empty.tasks() == []
    assert str(empty) == repr(empty) == "ClusterSpec({})"
    c = ClusterSpec({"ps": [], "worker": ["h:1"]})
    assert c and c.num_tasks("ps") == 0 and c.task_indices("ps") == [] and c.job_tasks("ps") == []
    assert c.as_dict() == {"worker": ["h:1"], "ps": []} and [str(t) for t in c.replicas()] == ["/job:worker/replica:0/task:0"]
    with pytest.raises(ClusterSpecError, match="has no tasks, so no task can coordinate it"):
        empty.coordinator()
    with pytest.raises(ClusterSpecError, match="unknown job name 'worker'; this cluster has no jobs"):
        empty.num_tasks("worker")


def test_sparse_task_indices_are_a_spec_but_not_a_process_group():
    c = ClusterSpec({"worker": {1: "h:2222", 3: "h:2223"}, "ps": ["h:1"]})
    assert c.num_tasks("worker") == 2 and c.task_indices("worker") == [1, 3] and c.gaps("worker") == [0, 2]
    assert c.task_address("worker", 3) == "h:2223" and c.job_tasks("worker") == [None, "h:2222", None, "h:2223"]
    assert c.as_dict() == {"worker": {1: "h:2222", 3: "h:2223"}, "ps": ["h:1"]}
    assert [str(t) for t in c.tasks()][:2] == ["/job:worker/replica:0/task:1", "/job:worker/replica:0/task:3"]
    assert ClusterSpec(c) == c and ClusterSpec({"worker": {"1": "h:2222", "3": "h:2223"}, "ps": ["h:1"]}) == c
    with pytest.raises(ClusterSpecError, match=r"task index 2 is not a task for job 'worker', which has tasks \[1, 3\]"):
        c.task_address("worker", 2)
    gaps = r"job 'worker' has tasks \[1, 3\], missing \[0, 2\]"
    with pytest.raises(ClusterSpecError, match="the replicas' process group needs every task index 0..n-1 of each job: " + gaps):
        c.replicas()
    with pytest.raises(ClusterSpecError, match="forming the cluster's process group needs .*" + gaps):
        c.rank_of("ps", 0)
    assert ClusterSpec({"ps": {1: "h:1"}, "worker": ["h:2"]}).replicas()  # a sparse ps job is no replica


def test_str_and_repr_list_jobs_sorted_as_tensorflow_does():
    c = ClusterSpec({"worker": ["h:2"], "ps": ["h:1"], "chief": ["h:3"]})
    assert str(c) == repr(c) == "ClusterSpec({'chief': ['h:3'], 'ps': ['h:1'], 'worker': ['h:2']})"
    assert c.jobs == ["chief", "worker", "ps"]  # towerflow's rank order, unchanged


@pytest.mark.parametrize("text", ["{}", '{"task": {}}', '{"task": {"type": "worker", "index": 0}}', '{"environment": "cloud"}'])
def test_a_tf_config_without_a_cluster_is_an_empty_spec(text):
    assert ClusterSpec.from_tf_config(text) == ClusterSpec({}) and not ClusterSpec.from_tf_config(text)


def test_from_json_file_plain_and_tf_config(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    (tmp_path / "tf.json").write_text(json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}}))
    assert ClusterSpec.from_json(str(tmp_path / "c.json")) == ClusterSpec(CLUSTER)
    assert ClusterSpec.from_json(str(tmp_path / "tf.json")) == ClusterSpec(CLUSTER)


def test_from_seed_flags():
    argv = "--ps_hosts=localhost:2222 --worker_hosts=localhost:2223,localhost:2224 --job_name=worker -task_index=1 --other x".split()
    spec, job, index = parse_flags(argv)
    assert spec == ClusterSpec(CLUSTER) and job == "worker" and index == 1
    assert ClusterSpec.from_flags(["--ps_hosts", "localhost:2222", "--worker-hosts", "localhost:2223,localhost:2224"]) == ClusterSpec(CLUSTER)


def test_from_tf_config():
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 0}})
    assert ClusterSpec.from_tf_config(text) == ClusterSpec(CLUSTER)


def test_from_torchrun_is_worker_only():
    c = ClusterSpec.from_torchrun({"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert c.as_dict() == {"worker": ["10.0.0.1:29501", "10.0.0.1:29502", "10.0.0.1:29503"]}


@pytest.mark.parametrize(
    "cluster, message",
    [
        ({"ps": ["localhost:2222"], "worker": ["127.0.0.1:2222"]}, "duplicate address: addresses '127.0.0.1:2222' and 'localhost:2222' \\(the same place\\) given to both /job:worker/task:0 and /job:ps/task:0"),
        ({"worker": ["h:1", "h:1"]}, "duplicate address: address 'h:1' given to both /job:worker/task:0 and /job:worker/task:1"),
        ({"worker": ["localhost:70000"]}, r"bad port '70000' in address 'localhost:70000' \(/job:worker/task:0\)"),
        ({"worker": ["localhost:http"]}, "bad port 'http'"),
        ({"worker": ["localhost"]}, "bad address 'localhost' \\(/job:worker/task:0\\): expected 'host:port'"),
        ({"worker": [":2222"]}, "the host is empty"),
        ({"1worker": ["h:1"]}, "bad job name '1worker'"),
        (["h:1"], "a cluster is a dict"),
        ({"worker": {-1: "h:1"}}, "job 'worker': bad task index -1"),
        ({"worker": {0: "h:1", 2: "h:1"}}, "duplicate address: address 'h:1' given to both /job:worker/task:0 and /job:worker/task:2"),
        ({"worker": ["h:1"], "ps": {"1": "h:1"}}, "given to both /job:worker/task:0 and /job:ps/task:1"),
    ],
)
def test_bad_specs_name_the_bad_entry(cluster, message):
    with pytest.raises(ClusterSpecError, match=message):
        ClusterSpec(cluster)


def test_port_0_is_any_free_port_in_a_cluster_of_one_task():
    assert ClusterSpec({"worker": ["localhost:0"]}).as_dict() == {"worker": ["localhost:0"]}
    assert ClusterSpec({"ps": [], "worker": ["10.0.0.1:0"]}).task_address("worker", 0) == "10.0.0.1:0"
    assert ClusterSpec.from_tf_config('{"cluster": {"worker": ["localhost:0"]}}').num_tasks("worker") == 1


@pytest.mark.parametrize(
    "cluster, named",
    [
        ({"worker": ["localhost:0", "localhost:2223"]}, "/job:worker/task:0 ('localhost:0')"),
        # two port-0 entries are not a duplicate address: the refusal names both
        ({"ps": ["localhost:0"], "worker": ["h:0"]}, "/job:worker/task:0 ('h:0'), /job:ps/task:0 ('localhost:0')"),
        ({"worker": {0: "h:1", 3: "h:0"}}, "/job:worker/task:3 ('h:0')"),
    ],
)
def test_port_0_in_a_cluster_of_several_tasks_is_refused_with_why_and_the_fix(cluster, named):
    with pytest.raises(ClusterSpecError) as e:
        ClusterSpec(cluster)
    text = str(e.value)
    assert text.startswith(f"port 0 in {named}: port 0 means 'any free port', which only a cluster of one task can use")
    assert "This cluster has 2 tasks, and each finds the others at the addresses in the spec" in text
    assert "Give each task a fixed port" in text and "towerflow launch --ps N --workers M" in text


def test_an_address_that_is_dialed_refuses_port_0():
    with pytest.raises(ClusterSpecError, match=r"bad port '0' in address 'localhost:0' \(the store\): expected an "
                                               r"integer in 1..65535 \(port 0, any free port, is only for a task's own entry"):
        split_address("localhost:0", "the store")
    assert split_address("localhost:0", any_port=True) == ("localhost", 0)


def test_unknown_job_and_index_out_of_range():
    c = ClusterSpec(CLUSTER)
    with pytest.raises(ClusterSpecError, match="unknown job name 'worke'.*Did you mean 'worker'"):
        c.num_tasks("worke")
    with pytest.raises(ClusterSpecError, match=r"task index 2 is out of range for job 'worker', which has 2 tasks \(0..1\)"):
        c.task_address("worker", 2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ClusterSpec.from_tf_config("{not json"), "TF_CONFIG is not valid JSON"),
        (lambda: ClusterSpec.from_tf_config(""), "TF_CONFIG is empty"),
        (lambda: ClusterSpec.from_torchrun({"WORLD_SIZE": "2"}), "torchrun variables missing: MASTER_ADDR, MASTER_PORT"),
        (lambda: ClusterSpec.from_torchrun({"WORLD_SIZE": "two", "MASTER_ADDR": "h", "MASTER_PORT": "1"}), "WORLD_SIZE='two'"),
        (lambda: ClusterSpec.from_flags(["--job_name", "ps"]), "no --ps_hosts"),
        (lambda: parse_flags(["--ps_hosts", "h:1", "--task_index", "x"]), "bad --task_index 'x'"),
        (lambda: ClusterSpec.from_json("/nonexistent/cluster.json"), "cannot read cluster file '/nonexistent/cluster.json'"),
    ],
)
def test_bad_inputs_in_every_format(call, message):
    with pytest.raises(ClusterSpecError, match=message):
        call()


def test_bad_json_file(tmp_path):
    (tmp_path / "c.json").write_text("{oops")
    with pytest.raises(ClusterSpecError, match="is not valid JSON"):
        ClusterSpec.from_json(str(tmp_path / "c.json"))


def test_errors_survive_pickling():
    from towerflow.errors import ClusterTimeoutError, RemoteError

    e = pickle.loads(pickle.dumps(ClusterTimeoutError("late", task="/job:ps/task:0", missing=["/job:worker/task:1"])))
    assert (str(e), e.task, e.missing) == ("late", "/job:ps/task:0", ("/job:worker/task:1",))
    r = pickle.loads(pickle.dumps(RemoteError("boom", task="/job:ps/task:0", remote_type="KeyError", remote_traceback="tb")))
    assert (r.task, r.remote_type, r.remote_traceback) == ("/job:ps/task:0", "KeyError", "tb")
