"""Tensors that live on a GPU or in pinned host memory, sent through the messaging layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from towerflow.cluster.calls import messaging
from towerflow.cluster.calls import wire
from towerflow.cluster.calls.wire_security import AUTHENTICATE, WireSecurity

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _echo(*args, **kwargs):
    return args, kwargs


@pytest.fixture
def pair():
    server = messaging.Endpoint("server", "127.0.0.1", WireSecurity(AUTHENTICATE, "t"), lambda peer: None, 10.0)
    book = {"server": server.address}
    client = messaging.Endpoint("client", "127.0.0.1", WireSecurity(AUTHENTICATE, "t"), book.get, 10.0)
    yield client
    client.close()
    server.close()


def test_tensors_on_the_gpu_arrive_on_the_host_with_their_values(pair):
    cuda = torch.device("cuda")
    sent = {
        "fp32": torch.randn(64, 32, device=cuda),
        "bf16": torch.randn(5, 4, device=cuda).to(torch.bfloat16),
        "fp16": torch.randn(7, device=cuda).half(),
        "strided": torch.arange(20., device=cuda).reshape(4, 5).t(),
        "big": torch.randn(300_000, device=cuda),  # over ZeroMQ's copy threshold
        "param": torch.nn.Parameter(torch.randn(3, 2, device=cuda)),
    }
    (_, got) = pair.call("server", _echo, (), sent).wait()
    for name, tensor in sent.items():
        assert got[name].device.type == "cpu", name
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor.detach().cpu()), name
    assert isinstance(got["param"], torch.nn.Parameter)


def test_a_pinned_tensor_is_framed_from_its_own_memory_without_a_copy():
    pinned = torch.randn(300_000).pin_memory()
    frames = wire.encode(1, wire.Call(_echo, (pinned,), {}))
    tensor_frame = frames[-1]
    address = np.frombuffer(tensor_frame, dtype=np.uint8).ctypes.data
    assert address == pinned.data_ptr()
    message = wire.decode(frames)
    assert torch.equal(message.args[0], pinned)


def test_a_gpu_tensor_is_copied_to_the_host_once_and_its_frame_holds_its_values():
    on_gpu = torch.arange(1000, dtype=torch.float32, device="cuda")
    frames = wire.encode(2, wire.Call(_echo, (on_gpu,), {}))
    assert len(frames) == 2  # the head, then one tensor frame
    assert np.array_equal(np.frombuffer(frames[-1], dtype=np.float32), np.arange(1000, dtype=np.float32))
