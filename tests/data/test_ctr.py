"""Synthetic CTR data: deterministic across processes, Criteo-shaped, power-law ids, a known ceiling a DLRM reaches.

The DLRM lives in examples/ctr_ps.py (the example is its one user, and the benchmark imports
it from there too, so all measure the same model); these tests load that file by path.
"""

import importlib.util
import itertools
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import towerflow
from towerflow.data import SyntheticCTR, auc, synthetic_ctr
from towerflow.errors import DataError

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ctr_ps.py"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ctr_ps():
    spec = importlib.util.spec_from_file_location("ctr_ps", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _take(stream, n):
    return list(itertools.islice(stream, n))


def test_same_seed_gives_every_process_the_same_batches_test_set_and_ceiling():
    a, b = synthetic_ctr(5000, seed=3, test_size=4000), synthetic_ctr(5000, seed=3, test_size=4000)
    for x, y in zip(_take(a.batches(64, worker=1, num_workers=2), 3), _take(b.batches(64, worker=1, num_workers=2), 3)):
        assert all(torch.equal(s, t) for s, t in zip(x, y))
    assert all(torch.equal(s, t) for s, t in zip(a.test_set(), b.test_set()))
    assert a.best_auc == b.best_auc
    other = synthetic_ctr(5000, seed=4, test_size=4000)
    assert not torch.equal(other.test_set()[1], a.test_set()[1])  # the seed picks the planted model and ids


def test_workers_read_different_streams_and_none_repeats_the_test_set():
    data = synthetic_ctr(5000, test_size=2000)
    w0, w1 = next(data.batches(256, 0, 2)), next(data.batches(256, 1, 2))
    assert not torch.equal(w0[1], w1[1]) and not torch.equal(w0[0], w1[0])
    assert not torch.equal(next(data.batches(256, 0, 2, seed=1))[0], w0[0])  # a new stream seed, new samples
    assert not torch.equal(data.test_set()[0][:256], w0[0])
    first, second = _take(data.batches(256), 2)
    assert not torch.equal(first[1], second[1])  # the stream moves on


def test_batches_are_criteo_shaped_and_ids_stay_in_each_tables_range():
    rows = [1, 3, 10, 1000] + [100_000] * 22
    data = synthetic_ctr(rows, test_size=1000)
    dense, cats, labels = next(data.batches(512))
    assert dense.dtype == torch.float32 and dense.shape == (512, 13)
    assert cats.dtype == torch.int64 and cats.shape == (512, 26)
    assert labels.dtype == torch.float32 and labels.shape == (512,) and set(labels.unique().tolist()) <= {0.0, 1.0}
    assert bool((cats >= 0).all()) and bool((cats < torch.tensor(rows)).all())
    assert cats[:, 0].unique().tolist() == [0] and len(cats[:, 2].unique()) > 3  # a 1-row table; a 10-row one in use


def test_ids_follow_a_power_law_with_the_frequent_ones_spread_over_the_id_range():
    data = synthetic_ctr(1000, test_size=1000)
    cats = torch.cat([c for _, c, _ in _take(data.batches(1024), 50)])  # 51,200 samples
    for t in (0, 13, 25):
        counts = torch.bincount(cats[:, t], minlength=1000)
        top = counts.sort(descending=True)
        assert top.values[0] > 100 * max(float(counts.median()), 1.0)  # the most frequent id dwarfs the median one
        assert top.values[:10].sum() > 0.4 * len(cats)  # the top 1% of ids cover a large share of the samples
        assert data.ranks(top.indices[:1].repeat(26).view(1, 26))[0, t] == 0  # ... and it is rank 0 of its table
        # Sharded 'div' (contiguous blocks) or 'mod' over 4 ps tasks, every task holds some of the 100 most frequent ids.
        frequent = top.indices[:100]
        assert torch.bincount(frequent // 250, minlength=4).min() >= 10
        assert torch.bincount(frequent % 4, minlength=4).min() >= 10


def test_labels_are_about_a_quarter_positive_and_the_planted_model_is_calibrated():
    data = synthetic_ctr(100_000, test_size=50_000)
    dense, cats, labels = data.test_set()
    assert 0.2 < float(labels.mean()) < 0.3
    p = data.true_probability(dense, cats)
    assert abs(float(p.mean()) - float(labels.mean())) < 0.01  # labels are drawn from exactly these probabilities
    assert 0.6 < data.best_auc < 0.95  # learnable, yet a perfect model is far from AUC 1
    assert abs(data.best_auc - auc(p, labels)) < 1e-12


def test_a_million_rows_per_table_store_no_per_id_arrays():
    data = synthetic_ctr(1_000_000)
    stored = sum(v.numel() * v.element_size() for v in vars(data).values() if isinstance(v, torch.Tensor))
    assert stored < 1 << 20  # the planted model is head effects only: under 1 MB for 26 million ids
    assert isinstance(data, SyntheticCTR) and "rows_per_table=1000000" in repr(data)


def _pairwise_auc(scores, labels):
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    return float(wins.mean())


@pytest.mark.parametrize("seed", range(8))
def test_auc_equals_the_pairwise_count_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 60, (1,), generator=g))
    labels = torch.randint(0, 2, (n,), generator=g).float()
    labels[0], labels[1] = 0.0, 1.0
    scores = torch.randint(0, 5, (n,), generator=g).float() / 4  # few distinct values: many ties
    assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)


def test_auc_known_values():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), labels) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), labels) == 0.0
    assert auc(torch.zeros(4), labels) == 0.5  # all tied: a coin flip
    assert auc([0.3, 0.7], [1, 0]) == 0.0  # lists work too


def test_auc_refuses_one_class_and_malformed_input():
    with pytest.raises(DataError, match=r"4 positives and 0 negatives: ROC AUC needs both classes"):
        auc(torch.rand(4), torch.ones(4))
    with pytest.raises(DataError, match="one score per label"):
        auc(torch.rand(3), torch.tensor([0.0, 1.0]))
    with pytest.raises(DataError, match="other than 0 and 1"):
        auc(torch.rand(2), torch.tensor([0.0, 2.0]))
    with pytest.raises(DataError, match="NaN"):
        auc(torch.tensor([0.1, float("nan")]), torch.tensor([0.0, 1.0]))


def test_bad_requests_say_what_was_expected():
    with pytest.raises(DataError, match=r"rows_per_table has 3 entries for num_tables=26"):
        synthetic_ctr([10, 10, 10])
    with pytest.raises(DataError, match="zipf_exponent=0"):
        synthetic_ctr(10, zipf_exponent=0)
    data = synthetic_ctr(10, test_size=100)
    with pytest.raises(DataError, match=r"worker=2 with num_workers=2.*strategy.replica_id"):
        next(data.batches(8, worker=2, num_workers=2))
    with pytest.raises(DataError, match="outside"):
        data.ranks(torch.full((1, 26), 10))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_dlrm_gets_within_0_02_of_the_best_auc_in_200_steps(ctr_ps):
    torch.manual_seed(0)
    data = synthetic_ctr(1000, test_size=20_000)
    model = ctr_ps.DLRM(data.rows_per_table)
    dense_optimizer, rows = ctr_ps.make_optimizer(model, "adagrad", *ctr_ps.DEFAULT_LR["adagrad"])
    model, optimizer = towerflow.OneDeviceStrategy("/cpu:0").setup(model, dense_optimizer, sparse_optimizer=rows)
    for dense, cats, labels in itertools.islice(data.batches(512), 200):
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(dense, cats), labels).backward()
        optimizer.step()
    assert ctr_ps.evaluate(model, data.test_set(), torch.device("cpu")) > data.best_auc - 0.02


def test_adam_steps_the_sparse_tables_and_the_dense_part(ctr_ps):
    model = ctr_ps.DLRM([20] * 26)
    before = [p.detach().clone() for p in model.parameters()]
    dense_optimizer, rows = ctr_ps.make_optimizer(model, "adam", 0.01, 0.01)
    assert isinstance(dense_optimizer, torch.optim.Adam) and rows == towerflow.ps.SparseAdam(lr=0.01)
    model, optimizer = towerflow.OneDeviceStrategy("/cpu:0").setup(model, dense_optimizer, sparse_optimizer=rows)
    dense, cats, labels = next(synthetic_ctr(20, test_size=10).batches(64))
    F.binary_cross_entropy_with_logits(model(dense, cats), labels).backward()
    assert model.tables[0].weight.grad.is_sparse
    optimizer.step()  # SparseAdam for the tables beside Adam for the rest
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert len(optimizer.state) == len(before) > 0  # both optimizers' state: a checkpoint holds them


def test_a_worker_can_build_the_dlrm_without_allocating_its_tables(ctr_ps):
    model = ctr_ps.DLRM([1_000_000] * 26, table_device="meta")
    assert all(t.weight.is_meta for t in model.tables)
    assert not any(p.is_meta for p in model.dense_parameters())


def test_the_example_reports_auc_against_the_best_and_the_wire_minimum(ctr_ps, capsys):
    test_auc, best = ctr_ps.main(["--rows", "1000", "--steps", "30", "--batch-size", "256", "--test-size", "4000"])
    out = capsys.readouterr().out
    assert f"test auc: {test_auc:.4f} (best possible: {best:.4f})" in out
    minimum = int(re.search(r"wire: 0 bytes/step \(one process: nothing travels; minimum (\d+)\)", out).group(1))
    dense_bytes = sum(p.numel() * 4 for p in ctr_ps.DLRM([1000] * 26).dense_parameters())
    assert 2 * dense_bytes + 2 * 26 * 16 * 4 < minimum < 2 * dense_bytes + 2 * 26 * 256 * 16 * 4  # rows touched
