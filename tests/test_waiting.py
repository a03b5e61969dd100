"""wait_until: the value once the condition holds, else the caller's error naming what is missing."""

import pytest

from towerflow._waiting import wait_until


def test_returns_the_conditions_value_once_it_holds():
    calls = iter([None, [], ["ps:0"]])
    assert wait_until(lambda: next(calls), 5, "never", interval=0.001) == ["ps:0"]


def test_past_the_timeout_raises_the_callers_error_with_what_is_missing():
    missing = ["/job:worker/task:1"]
    with pytest.raises(LookupError, match=r"missing: /job:worker/task:1$"):
        wait_until(lambda: False, 0.01, lambda: f"missing: {', '.join(missing)}", interval=0.001,
                   on_timeout=LookupError)


def test_without_an_error_it_returns_the_false_value():
    assert wait_until(lambda: 0, 0.01, "a count", interval=0.001, on_timeout=None) == 0
