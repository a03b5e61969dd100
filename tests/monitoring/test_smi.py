"""`towerflow smi` against a fake NVML at the library boundary, and the no-GPU path for real."""

import io
import json
import os
import subprocess
import sys
import types

import pytest

from towerflow.monitoring import nvml, smi


class FakeNVML:
    """The slice of pynvml that towerflow calls, answering like two Tesla T4s (one busy)."""

    def __init__(self, fail_init=None, count=2):
        self.fail_init = fail_init
        self.count = count
        self.shutdown_calls = 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"Tesla T4"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetTemperature(self, h, sensor):
        return [48, 83][h]

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=[0, 97][h], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        used = [0, 10240][h] << 20
        return types.SimpleNamespace(used=used, total=15079 << 20, free=(15079 << 20) - used)

    def nvmlDeviceGetPowerUsage(self, h):
        return [16000, 70000][h]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        if h == 0:
            raise RuntimeError("Not Supported")
        return 70000

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [] if h == 0 else [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=512 << 20)]


def test_query_reads_every_field_and_tolerates_unsupported_ones():
    fake = FakeNVML()
    gpus = nvml.query(fake)
    assert [g.name for g in gpus] == ["Tesla T4", "Tesla T4"]
    assert gpus[1].temperature_c == 83 and gpus[1].utilization_pct == 97
    assert (gpus[1].memory_used_mib, gpus[1].memory_total_mib) == (10240, 15079)
    assert (gpus[1].power_w, gpus[1].power_limit_w) == (70, 70)
    assert gpus[0].power_limit_w is None  # 'Not Supported' on that board
    process = gpus[1].processes[0]
    assert process.pid == os.getpid() and process.memory_mib == 512
    assert "python" in process.command or "pytest" in process.command
    assert fake.shutdown_calls == 1


class FakeNVMLWithV2(FakeNVML):
    """NVML of drivers since R510: the v2 memory query leaves the driver's reserved memory out of `used`."""

    nvmlMemory_v2 = 0x2000028
    RESERVED = 614 << 20

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        v1 = super().nvmlDeviceGetMemoryInfo(h)
        if version is None:
            return types.SimpleNamespace(used=v1.used + self.RESERVED, total=v1.total, free=v1.free - self.RESERVED)
        assert version == self.nvmlMemory_v2
        return types.SimpleNamespace(used=v1.used, reserved=self.RESERVED, total=v1.total, free=v1.free - self.RESERVED)


class FakeNVMLRefusingV2(FakeNVMLWithV2):
    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        if version is not None:
            raise RuntimeError("Function Not Found")
        return super().nvmlDeviceGetMemoryInfo(h)


def test_memory_used_is_what_nvidia_smi_shows_not_counting_the_drivers_reserve():
    assert [g.memory_used_mib for g in nvml.query(FakeNVMLWithV2())] == [0, 10240]
    # a driver without the v2 query: its v1 figure, the reserve included, rather than nothing
    assert [g.memory_used_mib for g in nvml.query(FakeNVMLRefusingV2())] == [614, 10854]


def test_text_view_matches_gpustat_shape():
    text = smi.render(smi.snapshot(FakeNVML()), colour=False)
    lines = text.splitlines()
    assert lines[1] == "[0] Tesla T4             |  48'C,   0 % |      ? W |      0 /  15079 MB |"
    assert lines[2].startswith("[1] Tesla T4             |  83'C,  97 % |   70 /  70 W |  10240 /  15079 MB | ")
    assert lines[2].endswith(f"/{os.getpid()}(512M)")
    assert lines[3].startswith("CPU  ")


def test_colour_only_when_asked():
    snap = smi.snapshot(FakeNVML())
    assert "\x1b[" not in smi.render(snap, colour=False)
    coloured = smi.render(snap, colour=True)
    assert "\x1b[31m 83'C" in coloured  # hot GPU in red


def test_json_output_is_the_snapshot():
    out = io.StringIO()
    assert smi.run(as_json=True, out=out, nvml=FakeNVML()) == 0
    data = json.loads(out.getvalue())
    assert [g["utilization_pct"] for g in data["gpus"]] == [0, 97]
    assert data["no_gpu_reason"] is None


def test_watch_redraws_each_frame():
    out = io.StringIO()
    smi.run(watch=0.01, out=out, nvml=FakeNVML(), max_frames=3, colour=False)
    assert out.getvalue().count("[1] Tesla T4") == 3


@pytest.mark.parametrize(
    "fake,reason",
    [
        (FakeNVML(fail_init=RuntimeError("Driver Not Loaded")), "no NVIDIA driver reachable (Driver Not Loaded)"),
        (FakeNVML(count=0), "the NVIDIA driver reports no GPU"),
    ],
)
def test_no_gpu_shows_the_reason_and_the_host(fake, reason):
    snap = smi.snapshot(fake)
    assert snap["gpus"] == [] and snap["no_gpu_reason"] == reason
    text = smi.render(snap)
    assert f"no GPU: {reason}" in text
    assert "RAM " in text and "load " in text


def test_cli_without_gpu_exits_zero_and_says_so():
    result = subprocess.run([sys.executable, "-m", "towerflow", "smi"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    if "no GPU:" in result.stdout:
        assert "CPU  " in result.stdout
    result = subprocess.run([sys.executable, "-m", "towerflow", "smi", "--watch", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "expected a positive number of seconds" in result.stderr
