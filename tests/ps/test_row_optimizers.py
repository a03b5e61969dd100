"""Row-wise optimizers: each equals its torch (or TF) counterpart on the rows a step touches, and nothing else moves."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from towerflow.errors import ParameterServerError
from towerflow.ps import FTRL, SparseAdagrad, SparseAdam, SparseSGD, row_optimizer_for
from towerflow.ps.tables.row_optimizers import coalesce

torch.set_num_threads(1)

ROWS, DIM = 10, 4
# ~5 steps, with repeated ids (coalesced before the update) and without; rows 8 and 9 are never touched
BATCHES = [[1, 3, 3, 7, 1], [0, 2, 5], [3, 3, 3], [6, 1, 4, 0], [7, 2, 2, 5]]
UNTOUCHED = [8, 9]


def _torch_run(make_opt, state_names, batches=BATCHES, seed=0):
    """Train nn.Embedding(sparse=True) with torch; yield (weight, {state}) after each step."""
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    opt = make_opt([emb.weight])
    coefs = torch.randn(len(batches), 5, DIM)
    initial = emb.weight.detach().clone()
    history = []
    for i, batch in enumerate(batches):
        opt.zero_grad()
        ids = torch.tensor(batch)
        (emb(ids) * coefs[i, : len(batch)]).pow(2).sum().backward()
        grad = emb.weight.grad.coalesce()
        opt.step()
        st = opt.state[emb.weight]
        history.append((grad.indices()[0].clone(), grad.values().clone(), emb.weight.detach().clone(),
                        {n: st[n].clone() for n in state_names}))
    return initial, history


def _ours(spec, initial, history, lr=None, lr_scale=1.0):
    values = initial.clone()
    state = spec.init_state(values)
    initial_state = {k: v.clone() for k, v in state.items()}
    for step, (rows, grads, want_values, want_state) in enumerate(history, start=1):
        spec.apply(values, state, rows, grads, step, lr=lr, lr_scale=lr_scale)
        torch.testing.assert_close(values, want_values, rtol=1e-6, atol=1e-7)
        for name in spec.state_names:
            torch.testing.assert_close(state[name], want_state[name], rtol=1e-6, atol=1e-7)
    assert torch.equal(values[UNTOUCHED], initial[UNTOUCHED])
    for name in spec.state_names:
        assert torch.equal(state[name][UNTOUCHED], initial_state[name][UNTOUCHED])


CASES = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1), SparseSGD(lr=0.1), ()),
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.1), SparseAdagrad(lr=0.1), ("sum",)),
    "adagrad-init-decay": (
        lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.3, lr_decay=0.05, eps=1e-6),
        SparseAdagrad(lr=0.1, initial_accumulator_value=0.3, eps=1e-6, lr_decay=0.05), ("sum",)),
    "sparse-adam": (lambda p: torch.optim.SparseAdam(p, lr=0.01), SparseAdam(lr=0.01), ("exp_avg", "exp_avg_sq")),
    "sparse-adam-betas": (lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.5, 0.9), eps=1e-6),
                          SparseAdam(lr=0.05, betas=(0.5, 0.9), eps=1e-6), ("exp_avg", "exp_avg_sq")),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's Adagrad, the reference
def test_row_optimizer_equals_torch_on_a_sparse_embedding(case):
    make_opt, spec, names = CASES[case]
    _ours(spec, *_torch_run(make_opt, names))


@pytest.mark.parametrize("case", sorted(CASES))
def test_lr_override_and_scale_replace_the_specs_lr(case):
    make_opt, spec, names = CASES[case]
    # torch trains with lr = 0.03 * 0.5; ours keeps its spec's lr but is handed lr=0.03, lr_scale=0.5
    torch_spec = dataclasses.replace(spec, lr=0.015)
    factory = {"sgd": torch.optim.SGD, "sparse": torch.optim.SparseAdam, "adagrad": torch.optim.Adagrad}
    cls = next(v for k, v in factory.items() if case.startswith(k))
    kw = {f.name: getattr(torch_spec, f.name) for f in dataclasses.fields(torch_spec)}
    _ours(spec, *_torch_run(lambda p: cls(p, **kw), names), lr=0.03, lr_scale=0.5)


def test_sparse_adam_counts_steps_per_shard_not_per_row():
    # a row first touched at step 3 gets step 3's bias correction, as torch.optim.SparseAdam gives it
    make_opt, spec, names = CASES["sparse-adam"]
    initial, history = _torch_run(make_opt, names, batches=[[0], [0], [5]])
    _ours(spec, initial, history)


# ---- FTRL against an independent scalar reference of TF's documented ApplyFtrl
def _ftrl_reference(w, accum, linear, g, lr, l1, l2, lr_power):
    """tf.raw_ops.ApplyFtrl, one element, in Python floats (float64)."""
    accum_new = accum + g * g
    linear = linear + g - (accum_new ** -lr_power - accum ** -lr_power) / lr * w
    quadratic = 1.0 / (accum_new ** lr_power * lr) + 2 * l2
    w = (math.copysign(1.0, linear) * l1 - linear) / quadratic if abs(linear) > l1 else 0.0
    return w, accum_new, linear


@pytest.mark.parametrize("lr, l1, l2, init_acc, lr_power", [
    (0.1, 0.0, 0.0, 0.1, -0.5),
    (0.05, 0.01, 0.2, 0.1, -0.5),
    (0.2, 0.001, 0.05, 0.5, -0.7),
    (0.1, 0.0, 0.1, 1.0, 0.0),  # fixed learning rate
])
def test_ftrl_equals_tf_apply_ftrl(lr, l1, l2, init_acc, lr_power):
    spec = FTRL(lr=lr, l1=l1, l2=l2, initial_accumulator_value=init_acc, lr_power=lr_power)
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64) * 0.1
    initial = values.clone()
    state = spec.init_state(values)
    ref_w, ref_a, ref_z = values.tolist(), [[init_acc] * DIM for _ in range(ROWS)], [[0.0] * DIM for _ in range(ROWS)]
    for step, batch in enumerate(BATCHES, start=1):
        ids = torch.tensor(batch)
        rows, grads = coalesce(ids, torch.randn(len(batch), DIM, generator=gen, dtype=torch.float64))
        spec.apply(values, state, rows, grads, step)
        for r, grow in zip(rows.tolist(), grads.tolist()):
            for d, g in enumerate(grow):
                ref_w[r][d], ref_a[r][d], ref_z[r][d] = _ftrl_reference(
                    ref_w[r][d], ref_a[r][d], ref_z[r][d], g, lr, l1, l2, lr_power)
    torch.testing.assert_close(values, torch.tensor(ref_w, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state["accum"], torch.tensor(ref_a, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state["linear"], torch.tensor(ref_z, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert torch.equal(values[UNTOUCHED], initial[UNTOUCHED])
    assert torch.equal(state["accum"][UNTOUCHED], torch.full((2, DIM), init_acc, dtype=torch.float64))
    assert torch.equal(state["linear"][UNTOUCHED], torch.zeros(2, DIM, dtype=torch.float64))


def test_ftrl_float32_matches_the_float64_reference():
    spec = FTRL(lr=0.1, l1=0.01, l2=0.1)
    gen = torch.Generator().manual_seed(0)
    v64 = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen) * 0.1
    v32 = v64.float()
    s64, s32 = spec.init_state(v64), spec.init_state(v32)
    for step, batch in enumerate(BATCHES, start=1):
        rows, grads = coalesce(torch.tensor(batch), torch.randn(len(batch), DIM, dtype=torch.float64, generator=gen))
        spec.apply(v64, s64, rows, grads, step)
        spec.apply(v32, s32, rows, grads.float(), step)
    torch.testing.assert_close(v32, v64.float(), rtol=1e-5, atol=1e-6)


def test_ftrl_l1_drives_small_weights_to_exactly_zero():
    rows = torch.arange(ROWS)
    grads = torch.full((ROWS, DIM), 0.01)
    grads[0] = 5.0  # row 0's gradient outweighs l1
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(ROWS, DIM, generator=gen)
    spec = FTRL(lr=0.1, l1=1.0)
    state = spec.init_state(values)
    for step in range(1, 4):
        spec.apply(values, state, rows, grads, step)
    assert (values[1:] == 0).all()
    assert (values[0] != 0).all()
    unregularized = torch.randn(ROWS, DIM, generator=gen)
    FTRL(lr=0.1).apply(unregularized, FTRL(lr=0.1).init_state(unregularized), rows, grads, 1)
    assert (unregularized != 0).all()


def test_coalesce_sums_the_rows_of_repeated_ids():
    ids, grads = coalesce(torch.tensor([3, 1, 3], dtype=torch.int32), torch.tensor([[1.0], [2.0], [4.0]]))
    assert ids.tolist() == [1, 3] and ids.dtype == torch.int64
    assert grads.tolist() == [[2.0], [5.0]]


# ---- specs: plain data that travels, and checked
@pytest.mark.parametrize("spec", [SparseSGD(0.1), SparseAdagrad(0.1, 0.1), SparseAdam(betas=[0.8, 0.9]), FTRL(0.1, l1=0.5)])
def test_specs_are_frozen_picklable_data(spec):
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(spec) == hash(pickle.loads(pickle.dumps(spec)))
    with pytest.raises(Exception):
        spec.lr = 1.0
    assert spec.describe().startswith(f"row-wise {type(spec).__name__}(lr=")


@pytest.mark.parametrize("make, text", [
    (lambda: SparseSGD(lr=-1.0), "SparseSGD(lr=-1.0): expected a learning rate >= 0"),
    (lambda: SparseAdagrad(lr=0.1, initial_accumulator_value=-0.1), "initial_accumulator_value=-0.1"),
    (lambda: SparseAdam(betas=(1.0, 0.9)), "SparseAdam(betas=(1.0, 0.9)): expected two coefficients in [0, 1)"),
    (lambda: FTRL(lr=0.0), "FTRL(lr=0.0): expected a learning rate > 0"),
    (lambda: FTRL(lr=0.1, lr_power=0.5), "FTRL(lr_power=0.5): expected lr_power <= 0"),
    (lambda: FTRL(lr=0.1, l1=-1), "FTRL(l1=-1.0): expected l1 >= 0"),
    (lambda: SparseSGD(lr="fast"), "SparseSGD(lr='fast'): expected a number"),
    (lambda: SparseAdam(betas=(0.9,)), "SparseAdam(betas=(0.9,)): expected two coefficients"),
    (lambda: SparseAdam(betas=0.9), "SparseAdam(betas=0.9): expected two coefficients"),
])
def test_bad_spec_values_are_refused(make, text):
    with pytest.raises(ParameterServerError) as err:
        make()
    assert text in str(err.value)


# ---- row_optimizer_for
def _p():
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize("make, want", [
    (lambda: torch.optim.SGD(_p(), lr=0.3), SparseSGD(0.3)),
    (lambda: torch.optim.SGD(_p(), lr=0.3, dampening=0.5), SparseSGD(0.3)),  # dampening only acts with momentum
    (lambda: torch.optim.Adagrad(_p(), lr=0.2, initial_accumulator_value=0.1, eps=1e-7, lr_decay=0.01),
     SparseAdagrad(0.2, 0.1, 1e-7, 0.01)),
    (lambda: torch.optim.Adam(_p(), lr=0.01, betas=(0.8, 0.99), eps=1e-6), SparseAdam(0.01, (0.8, 0.99), 1e-6)),
    (lambda: torch.optim.AdamW(_p(), lr=0.01, weight_decay=0.0), SparseAdam(0.01)),
    (lambda: torch.optim.SparseAdam(_p(), lr=0.02, betas=(0.5, 0.6)), SparseAdam(0.02, (0.5, 0.6))),
    (lambda: torch.optim.Adam(_p(), lr=torch.tensor(0.25)), SparseAdam(0.25)),  # a tensor lr
])
def test_row_optimizer_for_maps_torch_settings(make, want):
    assert row_optimizer_for(make()) == want


def test_row_optimizer_for_reads_the_group_asked_for():
    opt = torch.optim.SGD([{"params": _p(), "lr": 0.1}, {"params": _p(), "lr": 0.7}], lr=0.1)
    assert row_optimizer_for(opt, group=1) == SparseSGD(0.7)
    with pytest.raises(ParameterServerError, match=r"group=2\): SGD has 2 param group\(s\)"):
        row_optimizer_for(opt, group=2)
    with pytest.raises(ParameterServerError, match="expected a torch.optim.Optimizer"):
        row_optimizer_for("sgd")


@pytest.mark.parametrize("make, names", [
    (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9), ["SGD(momentum=0.9)", "momentum"]),
    (lambda: torch.optim.SGD(_p(), lr=0.1, weight_decay=1e-4), ["SGD(weight_decay=0.0001)", "weight decay"]),
    (lambda: torch.optim.Adagrad(_p(), lr=0.1, weight_decay=0.1), ["Adagrad(weight_decay=0.1)"]),
    (lambda: torch.optim.Adam(_p(), amsgrad=True), ["Adam(amsgrad=True)", "amsgrad"]),
    (lambda: torch.optim.AdamW(_p()), ["AdamW(weight_decay=0.01)"]),
    (lambda: torch.optim.Adam(_p(), maximize=True), ["Adam(maximize=True)"]),
    (lambda: torch.optim.RMSprop(_p()), ["RMSprop", "only SGD (no momentum), Adagrad"]),
    (lambda: torch.optim.LBFGS(_p()), ["LBFGS"]),
])
def test_row_optimizer_for_refuses_what_is_not_row_wise_exact(make, names):
    with pytest.raises(ParameterServerError) as err:
        row_optimizer_for(make())
    msg = str(err.value)
    for name in names:
        assert name in msg
    assert "no exact row-wise form" in msg
    assert "sparse_optimizer=towerflow.ps.SparseAdagrad(lr=...)" in msg and "strategy.setup" in msg


def test_row_optimizer_for_refuses_a_subclass_it_cannot_vouch_for():
    class MySGD(torch.optim.SGD):
        pass

    with pytest.raises(ParameterServerError, match="MySGD has no exact row-wise form"):
        row_optimizer_for(MySGD(_p(), lr=0.1))
