"""A batch's row keys on the wire: every key comes back exactly, in fewer bytes whenever their steps allow."""

import pickle

import pytest
import torch

from towerflow.ps import key_steps
from towerflow.ps.messages import RowPush, RowRead


def _unique(n: int, space: int, dtype=torch.int32, seed: int = 0) -> torch.Tensor:
    return torch.unique(torch.randint(0, space, (n,), generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("n, space, dtype, width", [
    (1000, 500_000, torch.int32, 2),   # a batch's rows of a half-million-row shard: steps in int16
    (300, 1_000, torch.int32, 1),      # a small table, most rows touched: steps in uint8
    (1000, 500_000, torch.int64, 2),   # a hash table's raw ids, packed the same way
])
def test_ascending_keys_travel_in_one_or_two_bytes_each_and_come_back_exactly(n, space, dtype, width):
    keys = _unique(n, space, dtype)
    packed = key_steps.pack(keys)
    assert isinstance(packed, key_steps.KeySteps)
    assert key_steps.nbytes(packed) <= keys.numel() * width + 16
    back = key_steps.unpack(pickle.loads(pickle.dumps(packed)))
    assert back.dtype == keys.dtype and torch.equal(back, keys)


def test_keys_whose_steps_spread_wide_travel_as_they_are():
    spread = torch.tensor([0, 1, 2, 3, 100_000, 100_001] + list(range(200_000, 200_020)), dtype=torch.int64)
    assert key_steps.pack(spread) is spread
    few = torch.tensor([5, 9, 200], dtype=torch.int32)
    assert key_steps.pack(few) is few  # a header would cost more than it saves


def test_keys_out_of_order_and_extreme_values_come_back_exactly():
    keys = torch.tensor([7, 3, 9, 1, 400, 2, 2, 30_000, 29_000] * 3, dtype=torch.int32)  # not ascending, repeats
    assert torch.equal(key_steps.unpack(key_steps.pack(keys)), keys)
    top = torch.arange(2 ** 31 - 40, 2 ** 31 - 1, dtype=torch.int32)
    assert torch.equal(key_steps.unpack(key_steps.pack(top)), top)
    far = torch.arange(2 ** 62, 2 ** 62 + 64, 3, dtype=torch.int64)
    assert torch.equal(key_steps.unpack(key_steps.pack(far)), far)


def test_a_read_and_a_push_count_the_bytes_that_travel_and_hand_the_ps_its_keys():
    keys = _unique(1000, 500_000)
    grads = torch.randn(keys.numel(), 16)
    packed = key_steps.pack(keys)
    push = pickle.loads(pickle.dumps(RowPush(("t",), (packed,), (grads,))))
    read = pickle.loads(pickle.dumps(RowRead(0, ("t",), (packed,), 1)))
    assert torch.equal(push.local_keys()[0], keys) and torch.equal(read.local_keys()[0], keys)
    row_bytes = grads.numel() * 4
    assert push.nbytes == row_bytes + key_steps.nbytes(packed)
    assert push.nbytes <= row_bytes * 1.035  # 2-byte steps against a 64-byte row, where int32 keys cost 1.0625
    assert read.nbytes == key_steps.nbytes(packed) < keys.numel() * 4
