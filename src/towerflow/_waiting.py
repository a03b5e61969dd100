"""Polling until a condition holds or a deadline passes, with an error that names what is missing."""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar, Union

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout: float,
    what: Union[str, Callable[[], str]],
    interval: float = 0.1,
    on_timeout: Optional[Callable[[str], BaseException]] = TimeoutError,
) -> T:
    """Call `condition` every `interval` s until it returns a true value, and return that value.

    It is asked once more after `timeout` s have passed; if it still returns a false value, raise
    `on_timeout(text)`, where text is `what` (or what `what()` returns then: it may name what is still
    missing). With `on_timeout=None`, return that false value instead.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            if on_timeout is None:
                return value
            raise on_timeout(what() if callable(what) else what)
        time.sleep(interval)
