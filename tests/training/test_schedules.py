"""Learning-rate schedules keyed on the global step."""

import math

import pytest

from towerflow.errors import ConfigError
from towerflow.training import cosine_decay, exponential_decay, piecewise_constant


def test_exponential_decay_smooth_and_staircase():
    smooth = exponential_decay(1.0, 10, 0.5)
    stairs = exponential_decay(1.0, 10, 0.5, staircase=True)
    assert smooth(0) == 1.0 and math.isclose(smooth(5), 0.5**0.5) and math.isclose(smooth(20), 0.25)
    assert stairs(9) == 1.0 and stairs(10) == 0.5 and stairs(25) == 0.25


def test_piecewise_constant_uses_tf_boundaries():
    s = piecewise_constant([10, 20], [1.0, 0.5, 0.1])
    assert [s(0), s(10), s(11), s(20), s(21)] == [1.0, 1.0, 0.5, 0.5, 0.1]


def test_cosine_decay_with_warmup():
    s = cosine_decay(1.0, 100, alpha=0.1, warmup_steps=10)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0) and s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


@pytest.mark.parametrize("make", [lambda: exponential_decay(1, 0, 0.5), lambda: piecewise_constant([2, 1], [1, 2, 3]),
                                  lambda: piecewise_constant([1], [1]), lambda: cosine_decay(1, 0)])
def test_bad_schedules_are_refused(make):
    with pytest.raises(ConfigError, match="expected"):
        make()
