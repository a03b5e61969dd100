import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from towerflow.errors import CheckpointMismatchError
from towerflow.session import CheckpointManager


def _model(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def test_round_trip_restores_parameters_optimizer_and_step(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    manager = CheckpointManager(str(tmp_path))
    manager.save(7, model, opt, data_state={"epoch": 2, "position": 40})
    fresh = _model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    restored = manager.restore(fresh, fresh_opt)
    assert restored.step == 7 and restored.data_state == {"epoch": 2, "position": 40}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_manifest_describes_the_checkpoint(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    manager.save(3, _model())
    manifest = json.loads((tmp_path / "ckpt-0000000003.json").read_text())
    assert manifest["step"] == 3 and manifest["file"] == "ckpt-0000000003.pt"
    assert manifest["tensors"]["0.weight"] == {"shape": [8, 4], "dtype": "float32"}
    assert manifest["bytes"] == os.path.getsize(tmp_path / "ckpt-0000000003.pt")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_only_the_newest_n_are_kept(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, _model())
    assert [c.step for c in manager.checkpoints()] == [3, 4]
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt-0000000003.json", "ckpt-0000000003.pt", "ckpt-0000000004.json", "ckpt-0000000004.pt",
    ]


def test_corrupt_newest_is_skipped_for_the_previous_with_a_warning(tmp_path, caplog):
    manager = CheckpointManager(str(tmp_path))
    good = _model()
    manager.save(1, good)
    with torch.no_grad():
        good[0].weight.add_(1)
    manager.save(2, good)
    path = tmp_path / "ckpt-0000000002.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip a byte: same size, wrong checksum
    path.write_bytes(bytes(data))
    fresh = _model(8)
    restored = manager.restore(fresh)
    assert restored.step == 1
    assert "skipping checkpoint" in caplog.text and "corrupt" in caplog.text
    assert torch.equal(fresh[0].weight, _model()[0].weight)


def test_truncated_payload_is_skipped(tmp_path, caplog):
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, _model())
    manager.save(2, _model())
    path = tmp_path / "ckpt-0000000002.pt"
    path.write_bytes(path.read_bytes()[:100])
    assert manager.latest().step == 1
    assert "the manifest says" in caplog.text


def test_checkpoint_of_another_model_names_the_mismatched_tensors(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, _model(width=8))
    with pytest.raises(CheckpointMismatchError) as info:
        manager.restore(_model(width=16))
    err = info.value
    assert "0.weight: checkpoint float32[8, 4] vs model float32[16, 4]" in str(err)
    assert "different model" in str(err)
    assert len(err.mismatched) == 3  # 0.weight, 0.bias, 2.weight
    with pytest.raises(CheckpointMismatchError, match="not in the model: 2.bias"):
        manager.restore(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2, bias=False)))


def test_empty_directory_restores_nothing(tmp_path):
    assert CheckpointManager(str(tmp_path / "none")).restore(_model()) is None


_SAVER = textwrap.dedent(
    """
    import io, sys, time, torch, torch.nn as nn
    from towerflow.session import CheckpointManager, checkpoint
    manager = CheckpointManager(sys.argv[1])
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
    manager.save(1, model)
    real_save = torch.save

    def half_then_hang(obj, f):  # the process dies here, half of step 2 on disk
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        print("halfway", flush=True)
        time.sleep(600)

    checkpoint.torch.save = half_then_hang
    with torch.no_grad():
        model.weight.fill_(2.0)
    manager.save(2, model)
    """
)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_usable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "halfway"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any(name.endswith(".tmp") for name in os.listdir(tmp_path))  # the torn write is there...
    model = nn.Linear(4, 2)
    restored = CheckpointManager(str(tmp_path)).restore(model)
    assert restored.step == 1  # ...and ignored: step 1 is the newest checkpoint
    assert torch.equal(model.weight, torch.ones(2, 4))
