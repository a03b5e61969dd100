"""GPU-only checks, run on the device machine: CUDA placement, mixed precision, host variables, NCCL."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import towerflow
from _replicas import REPO, run_replicas

pytestmark = pytest.mark.gpu


def _train(strategy, steps=20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model, opt = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())
    losses = []
    for _, batch in zip(range(steps), strategy.distribute_loader(data, batch_size=64).forever()):
        assert batch[0].device.type == "cuda"
        losses.append(float(towerflow.train_step(strategy, model, opt, batch, F.cross_entropy)))
    return model, opt, losses


def test_one_device_defaults_to_the_first_gpu():
    strategy = towerflow.strategy_from_env()
    assert strategy.device == torch.device("cuda", 0) and strategy.device_name.endswith("GPU:0")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision):
    strategy = towerflow.OneDeviceStrategy(mixed_precision=precision)
    _, opt, losses = _train(strategy)
    assert (opt.scaler is not None) == (precision == "fp16")
    assert losses[-1] < losses[0]


def test_variables_on_the_cpu_keep_masters_on_the_host():
    strategy = towerflow.OneDeviceStrategy(variables_on="cpu")
    model, opt, losses = _train(strategy)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(p.device.type == "cpu" for g in opt.param_groups for p in g["params"])
    assert losses[-1] < losses[0]


def test_training_copies_show_in_the_placement_log():
    towerflow.configure(log_device_placement="summary")
    _train(towerflow.OneDeviceStrategy(), steps=4)
    assert towerflow.placement_log().summary().host_to_device_bytes >= 4 * 64 * 32 * 4


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_replicas_on_gpus_converge():
    """Two replicas: NCCL on two GPUs, or gloo on two logical devices of one GPU."""
    script = os.path.join(REPO, "examples", "mnist_sync.py")
    results = run_replicas([script, "--steps", "300"], 2, timeout=150)
    assert "test accuracy: 0.9" in results[0].stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_seed_towers_example_trains_as_two_replicas_of_one_gpu():
    """Seed 001's CIFAR-10 towers (examples/cifar10_towers.py), two replicas: two GPUs, or two logical ones of one."""
    script = os.path.join(REPO, "examples", "cifar10_towers.py")
    results = run_replicas([script, "--steps", "30", "--batch-size", "64"], 2, timeout=150)
    assert "test accuracy: " in results[0].stdout and "replica 0 of 2" in results[0].stdout


_LOGICAL_CAP = """
import torch, towerflow
towerflow.configure(logical_devices={"GPU:0": [2048, 6144]})
strategy = towerflow.MirroredStrategy()
try:
    torch.empty(4 << 30, dtype=torch.uint8, device=strategy.device)
    fits = "fits"
except torch.cuda.OutOfMemoryError:
    fits = "refused"
print(strategy.device_name.rsplit("/", 1)[-1], strategy.memory_cap >> 20, fits, flush=True)
strategy.shutdown()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_replicas_on_logical_gpus_of_one_card_each_get_their_own_memory_limit(tmp_path):
    script = tmp_path / "logical_cap.py"
    script.write_text(_LOGICAL_CAP)
    results = run_replicas([str(script)], 2, timeout=150)
    assert [r.stdout.split() for r in results] == [["device:GPU:0", "2048", "refused"], ["device:GPU:1", "6144", "fits"]]


def test_a_hash_embedding_in_one_process_trains_on_the_gpu():
    """The rows stay on the host (the ps's store); each forward's rows go to the GPU and their gradients come back."""
    from towerflow.ps import HashEmbedding, SparseAdagrad

    class Clicks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ids = HashEmbedding(4, mode="sum")
            self.head = torch.nn.Linear(4, 2)

        def forward(self, ids):
            return self.head(self.ids(ids))

    torch.manual_seed(0)
    strategy = towerflow.OneDeviceStrategy("/gpu:0")
    model = Clicks()
    model, opt = strategy.setup(model, torch.optim.Adam(model.head.parameters(), lr=0.05),
                                sparse_optimizer=SparseAdagrad(lr=0.5))
    losses = []
    for step in range(100):
        ids = 10 ** 12 + torch.randint(0, 50, (64, 3), generator=torch.Generator().manual_seed(step))
        labels = (ids % 2 == 0).sum(1).clamp(max=1)
        loss = towerflow.train_step(strategy, model, opt, (ids.cuda(), labels.cuda()), F.cross_entropy)
        assert loss.device.type == "cuda"
        losses.append(float(loss))
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert strategy.hash_tables.metrics()["ids"]["rows"] == 50
