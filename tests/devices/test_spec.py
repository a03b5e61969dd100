import pickle

import pytest
import torch

from towerflow import DeviceSpec, DeviceSpecError

CANONICAL = [
    ("/job:ps/replica:0/task:1/device:GPU:0", "/job:ps/replica:0/task:1/device:GPU:0"),
    ("/gpu:1", "/device:GPU:1"),
    ("/GPU:1", "/device:GPU:1"),
    ("/cpu:0", "/device:CPU:0"),
    ("/device:GPU:0", "/device:GPU:0"),
    ("/device:gpu:0", "/device:GPU:0"),
    ("GPU:0", "/device:GPU:0"),
    ("/job:ps/task:1", "/job:ps/task:1"),
    ("/job:worker", "/job:worker"),
    ("cuda:1", "/device:GPU:1"),
    ("cuda", "/device:GPU:*"),
    ("cpu", "/device:CPU:*"),
    ("/device:GPU:*", "/device:GPU:*"),
    ("/device:TPU:3", "/device:TPU:3"),
    ("/device:XLA_GPU:0", "/device:XLA_GPU:0"),
    ("xla_cpu:0", "/device:XLA_CPU:0"),
    ("/task:2/job:worker", "/job:worker/task:2"),
    ("/job:localhost/replica:0/task:0/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:0"),
    ("/device:MyFunnyDevice:2", "/device:MyFunnyDevice:2"),
    ("/job:worker/task:1/device:my_dev_2:*", "/job:worker/task:1/device:my_dev_2:*"),
    ("/device:*:1", "/device:*:1"),
    ("", ""),
]


@pytest.mark.parametrize("text,expected", CANONICAL)
def test_parse_and_format_round_trip(text, expected):
    spec = DeviceSpec.from_string(text)
    assert spec.to_string() == expected
    assert DeviceSpec.from_string(spec.to_string()) == spec


def test_fields_are_exposed_like_tf():
    spec = DeviceSpec.from_string("/job:ps/replica:0/task:1/device:GPU:2")
    assert (spec.job, spec.replica, spec.task, spec.device_type, spec.device_index) == ("ps", 0, 1, "GPU", 2)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("/gpo:0", "did you mean 'gpu'"),
        ("/job:", "cannot parse 'job:'"),
        ("/task:x", "bad task 'x'"),
        ("/replica:-1", "bad replica '-1'"),
        ("/device:GPU:one", "bad device index 'one'"),
        ("/job:ps/job:worker", "job given twice"),
        ("/gpu:0/cpu:1", "device_type given twice"),
        ("/job:9ps", "bad job name '9ps'"),
        ("/FPGA:0", "a plug-in device type is written in full: '/device:FPGA:<n>'"),
        ("/device:My-Dev:0", "bad device type 'My-Dev'"),
        ("/device:9x:0", "bad device type '9x'"),
        ("/foo", "cannot parse 'foo'"),
    ],
)
def test_malformed_names_the_bad_part_and_shows_the_grammar(text, fragment):
    with pytest.raises(DeviceSpecError) as info:
        DeviceSpec.from_string(text)
    message = str(info.value)
    assert fragment.lower() in message.lower()
    assert "/job:<name>/replica:<n>/task:<n>/device:<TYPE>:<n>" in message or "expected" in message


def test_malformed_is_a_value_error():
    with pytest.raises(ValueError):
        DeviceSpec.from_string("/gpu:x")


def test_merge_inner_overrides_and_unset_fields_inherit():
    outer = DeviceSpec.from_string("/job:worker/task:1")
    inner = DeviceSpec.from_string("/gpu:0")
    assert outer.merge(inner).to_string() == "/job:worker/task:1/device:GPU:0"
    assert outer.merge("/job:ps").to_string() == "/job:ps/task:1"
    assert inner.merge("/cpu:1").to_string() == "/device:CPU:1"
    # TF merges type and index independently.
    assert DeviceSpec.from_string("/gpu:1").merge(DeviceSpec(device_type="CPU")).to_string() == "/device:CPU:1"
    assert outer.merge(None) == outer


def test_parse_accepts_torch_devices_and_specs():
    assert DeviceSpec.parse(torch.device("cuda", 1)).to_string() == "/device:GPU:1"
    assert DeviceSpec.parse(torch.device("cpu")).to_string() == "/device:CPU:*"
    spec = DeviceSpec(job="ps", task=0)
    assert DeviceSpec.parse(spec) is spec
    assert DeviceSpec.parse(None).is_empty


def test_constructor_validates():
    with pytest.raises(DeviceSpecError):
        DeviceSpec(task=-1)
    with pytest.raises(DeviceSpecError, match="bad device type 'quantum-1'"):
        DeviceSpec(device_type="quantum-1")
    assert DeviceSpec(device_type="cuda", device_index=0).device_type == "GPU"
    assert DeviceSpec(device_type="quantum", device_index=0).to_string() == "/device:quantum:0"


def test_plug_in_types_parse_as_written_and_known_types_are_canonical():
    # TF parses any device type in the long form and keeps its spelling; only its own types are canonicalised.
    spec = DeviceSpec.from_string("/job:worker/replica:0/task:1/device:MyFunnyDevice:2")
    assert (spec.job, spec.task, spec.device_type, spec.device_index) == ("worker", 1, "MyFunnyDevice", 2)
    assert DeviceSpec.from_string("/device:myfunnydevice:2") != spec.replace(job=None, replica=None, task=None)
    assert DeviceSpec.from_string("/device:gpu:0").device_type == "GPU"
    assert DeviceSpec.from_string("/job:ps").merge("/device:MyFunnyDevice:0").to_string() == "/job:ps/device:MyFunnyDevice:0"
    assert DeviceSpec.parse(torch.device("meta")).to_string() == "/device:meta:*"  # torch's own types too


def test_specs_are_hashable_and_picklable():
    spec = DeviceSpec.from_string("/job:ps/task:0/device:CPU:0")
    assert {spec: 1}[DeviceSpec.from_string("/job:ps/task:0/cpu:0")] == 1
    assert pickle.loads(pickle.dumps(spec)) == spec
