"""The towers' threads: tower 0 in the calling thread, tower i > 0 always in thread i (`TowerPool`).

Each thread keeps its own torch thread count (`threads_per_tower`), so the towers' ops do not
oversubscribe the cores; between steps the calling thread may take every tower's threads
(`all_threads`) for the optimizer's update, while the other towers wait for work.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, List, Optional

import torch

from towerflow.errors import StrategyError


def default_threads_per_tower(num_towers: int) -> int:
    """The host's cores split among the towers (at least one thread each)."""
    return max(1, (os.cpu_count() or 1) // num_towers)


@contextlib.contextmanager
def _torch_threads(count: Optional[int]) -> Iterator[None]:
    """This thread at `count` torch threads for the block, then back (None: as it is)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class TowerPool:
    """Tower 0 runs in the calling thread, tower i > 0 always in thread i; each with its own torch thread count."""

    def __init__(self, num_towers: int, threads_per_tower: Optional[int]):
        self.num_towers = num_towers
        self.threads_per_tower = threads_per_tower
        self._inboxes: List[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_towers - 1)]
        main_threads = torch.get_num_threads()
        ready = threading.Barrier(num_towers)
        self._threads = [threading.Thread(target=self._serve, args=(i, threads_per_tower, ready), daemon=True,
                                          name=f"towerflow-tower-{i}") for i in range(1, num_towers)]
        for t in self._threads:
            t.start()
        ready.wait()
        # torch.set_num_threads in a tower's thread also becomes the count new threads start with:
        # give this thread's count back to the process (this thread's own count is unchanged).
        torch.set_num_threads(main_threads)
        self._closed = False

    def _serve(self, index: int, threads: Optional[int], ready: threading.Barrier) -> None:
        torch.get_num_threads()  # torch sets a thread's count from the process's on first use: do that first
        if threads is not None:
            torch.set_num_threads(threads)
        ready.wait()
        inbox = self._inboxes[index - 1]
        while True:
            job = inbox.get()
            if job is None:
                return
            fn, future = job
            try:
                future.set_result(fn(index))
            except BaseException as e:  # handed to the caller, which re-raises it
                future.set_exception(e)
            # dropped before waiting for the next job: what `fn` holds (a step's gradients) must not outlive
            # the step, or autograd copies the summed gradients into .grad instead of taking them
            job = fn = future = None

    def _in_caller(self, fn: Callable[[int], Any]) -> Any:
        with _torch_threads(self.threads_per_tower):
            return fn(0)

    def all_threads(self) -> contextlib.AbstractContextManager:
        """The calling thread with every tower's torch threads, for work between steps (the optimizer's update):
        its elementwise ops then split over the cores the towers use, which sit idle meanwhile."""
        # threads_per_tower None: OMP_NUM_THREADS is set and the counts are left alone
        return _torch_threads(self.num_towers * self.threads_per_tower if self.threads_per_tower else None)

    def run(self, fn: Callable[[int], Any], count: Optional[int] = None) -> List[Any]:
        """[fn(0), ..., fn(count - 1)], fn(i) in tower i's thread, all at once; the first tower's error is raised."""
        if self._closed:
            raise StrategyError("the towers' threads are closed (strategy.shutdown() ran): set up the model again")
        futures = [Future() for _ in range((count if count is not None else self.num_towers) - 1)]
        for inbox, future in zip(self._inboxes, futures):
            inbox.put((fn, future))
        first, errors = None, [None]
        try:
            first = self._in_caller(fn)
        except BaseException as e:
            errors[0] = e
        errors += [f.exception() for f in futures]  # waits for every tower, so none is left running
        for i, error in enumerate(errors):
            if error is not None:
                if hasattr(error, "add_note"):
                    error.add_note(f"(raised in tower {i} of {self.num_towers})")
                raise error
        return [first, *(f.result() for f in futures)]

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._threads, self._closed = [], True
