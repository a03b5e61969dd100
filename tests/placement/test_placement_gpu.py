"""Placement on a real CUDA GPU; skipped on machines without one (run on the device machine)."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import towerflow
from towerflow import PlacementError

pytestmark = pytest.mark.gpu


def _fresh_python(code: str, timeout: float = 120) -> str:
    """stdout of `code` run in a new interpreter: options that must come before CUDA starts get a fresh process."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_gpu_is_listed_with_its_properties():
    gpu = [d for d in towerflow.list_devices() if d.device_type == "GPU"][0]
    assert gpu.name == "/job:localhost/replica:0/task:0/device:GPU:0"
    assert gpu.torch_device == torch.device("cuda:0")
    assert gpu.memory_bytes > 1 << 30
    assert gpu.compute_capability and gpu.compute_capability[0] >= 3
    assert towerflow.gpu_device_name() == "/device:GPU:0"
    assert towerflow.is_gpu_available()


def test_ops_move_to_the_gpu_and_bytes_are_counted_both_ways():
    towerflow.configure(log_device_placement="summary")
    host = torch.ones(1024)  # 4 KiB
    with towerflow.device("/gpu:0"):
        on_gpu = host * 2
        made_there = torch.zeros(10)
    assert on_gpu.is_cuda and made_there.is_cuda
    with towerflow.device("/cpu:0"):
        back = on_gpu + 1
    assert back.device.type == "cpu"
    summary = towerflow.placement_log().summary()
    assert summary.host_to_device_bytes == 4096
    assert summary.device_to_host_bytes == 4096


# Ops with no CUDA kernel in some torch release; torch adds kernels over time, so the test takes the first
# that still has none here. Each: (what it is, inputs on the host, the op, its result's first value).
_CPU_ONLY_CANDIDATES = [
    ("int64 matmul", lambda: (torch.ones(4, 4, dtype=torch.int64),), lambda a: a @ a, 4),
    ("int32 matmul", lambda: (torch.ones(4, 4, dtype=torch.int32),), lambda a: a @ a, 4),
    ("lstsq with the gelsd driver", lambda: (torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64)),
     lambda a, b: torch.linalg.lstsq(a, b, driver="gelsd").solution, 1.0),
]


def _an_op_without_a_cuda_kernel():
    from towerflow.placement.mode import _MISSING_KERNEL
    for name, inputs, op, first in _CPU_ONLY_CANDIDATES:
        try:
            op(*(t.cuda() for t in inputs()))
        except (RuntimeError, NotImplementedError) as e:
            if isinstance(e, NotImplementedError) or _MISSING_KERNEL.search(str(e)):
                return inputs, op, first
    pytest.skip(f"this torch has CUDA kernels for every candidate: {[c[0] for c in _CPU_ONLY_CANDIDATES]}")


def test_an_op_with_no_cuda_kernel_is_refused_and_soft_placement_runs_it_on_the_cpu():
    inputs, op, first = _an_op_without_a_cuda_kernel()
    with pytest.raises(PlacementError, match="no kernel on /device:GPU:0"):
        with towerflow.device("/gpu:0"):
            op(*inputs())
    towerflow.configure(allow_soft_placement=True, log_device_placement="summary")
    with towerflow.device("/gpu:0"):
        result = op(*inputs())
    fallbacks = [r.fallback for r in towerflow.placement_log().records if r.fallback]  # read before more ops log
    assert result.device.type == "cpu" and result.reshape(-1)[0].item() == first
    assert fallbacks and fallbacks[-1].startswith("no kernel on /device:GPU:0"), fallbacks


def test_model_parallel_on_two_logical_gpus_matches_one_gpu():
    towerflow.configure(logical_devices={"GPU:0": 2})

    def train(devices):
        torch.manual_seed(0)
        with towerflow.device(devices[0]):
            first = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        with towerflow.device(devices[1]):
            second = nn.Linear(32, 2)
        model = nn.Sequential(first, second)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
        y = (x.sum(1) > 0).long()
        for _ in range(10):
            out = model(x)
            loss = nn.functional.cross_entropy(out, y.to(out.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    assert train(["/gpu:0", "/gpu:1"]) == pytest.approx(train(["/gpu:0", "/gpu:0"]), rel=1e-5)


def test_memory_fraction_caps_allocations():
    towerflow.configure(gpu_memory_fraction=0.1)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda:0")
    finally:
        towerflow.configure(gpu_memory_fraction=None)


def test_allow_growth_false_reserves_up_front():
    code = (
        "import torch, towerflow\n"
        "towerflow.configure(allow_growth=False, gpu_memory_fraction=0.2)\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "print(torch.cuda.memory_reserved(0) / total)\n"
    )
    assert 0.1 < float(_fresh_python(code).strip()) <= 0.2


def test_visible_devices_after_cuda_started_is_refused():
    torch.zeros(1, device="cuda")
    with pytest.raises(towerflow.ConfigError, match="CUDA runtime already started"):
        towerflow.configure(visible_devices=[0])


def test_a_fraction_of_0_4_stops_allocation_at_40_percent_of_the_card_as_nvml_sees_it():
    """TF's per_process_gpu_memory_fraction=0.4: allocations stop at 40% of the card; NVML, not torch, measures it."""
    pytest.importorskip("pynvml")
    code = (
        "import pynvml, torch, towerflow\n"
        "pynvml.nvmlInit()\n"
        "handle = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
        "before = pynvml.nvmlDeviceGetMemoryInfo(handle).used\n"
        "towerflow.configure(gpu_memory_fraction=0.4)\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "held = []\n"
        "try:\n"
        "    while True:\n"
        "        held.append(torch.empty(256 << 20, dtype=torch.uint8, device='cuda'))\n"
        "except torch.cuda.OutOfMemoryError:\n"
        "    pass\n"
        "torch.cuda.synchronize()\n"
        "after = pynvml.nvmlDeviceGetMemoryInfo(handle).used\n"
        "print(len(held) * (256 << 20) / total, (after - before) / total)\n"
    )
    allocated, seen_by_nvml = map(float, _fresh_python(code, timeout=180).split())
    assert 0.38 <= allocated <= 0.40  # stopped at the cap, within one 256 MiB block
    assert seen_by_nvml <= 0.40 + 0.02  # the card's own count: the cap plus the CUDA context (~0.5 GiB)


def test_hiding_every_gpu_leaves_the_cpu_alone():
    code = (
        "import towerflow\n"
        "towerflow.configure(visible_devices=[])\n"
        "print(','.join(d.device_type for d in towerflow.list_devices()), towerflow.is_gpu_available())\n"
    )
    assert _fresh_python(code).split() == ["CPU", "False"]


def test_a_random_op_with_a_host_generator_runs_on_the_host_under_a_gpu_scope():
    """A generator pins its op to its device, as an explicit device= does; the log says why."""
    towerflow.configure(log_device_placement="summary")
    with towerflow.device("/gpu:0"):
        drawn = torch.rand(4, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        made_there = torch.ones(2)
    reasons = [r.fallback for r in towerflow.placement_log().records if r.fallback]
    assert drawn.device.type == "cpu" and made_there.is_cuda
    assert torch.equal(drawn, torch.rand(4, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    assert reasons == ["its generator is on cpu"], reasons
