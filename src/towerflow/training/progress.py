"""Progress of a training loop: a tqdm bar on an interactive terminal, plain lines otherwise.

Only the chief shows anything. Throughput is reported per replica and in total
(samples/s over the global batch), measured from the second step so start-up does not count.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Optional


class Progress:
    """Call `update(loss)` once per step after the strategy's loader handed out the batch."""

    def __init__(self, strategy, total_steps: int, log_every: int = 50, desc: str = "train",
                 stream: Optional[IO[str]] = None, bar: Optional[bool] = None):
        self.strategy = strategy
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.stream = stream or sys.stderr
        self.enabled = strategy.is_chief
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        if self.enabled and (is_tty if bar is None else bar):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, desc=desc, file=self.stream, dynamic_ncols=True)
        self.desc = desc
        self.steps = 0
        self.local_samples = self.global_samples = 0
        self._t0: Optional[float] = None

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0 if self._t0 is not None else 0.0

    @property
    def samples_per_sec(self) -> float:
        """All replicas together."""
        return self.global_samples / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def samples_per_sec_per_replica(self) -> float:
        return self.local_samples / self.elapsed if self.elapsed > 0 else 0.0

    def update(self, loss=None) -> None:
        self.steps += 1
        batch = self.strategy.last_batch
        if self._t0 is None:
            self._t0 = time.perf_counter()  # step 1 is warm-up: the clock starts after it
        elif batch is not None:
            self.local_samples += len(batch.indices)
            self.global_samples += batch.global_size
        if not self.enabled:
            return
        loss_text = f"{float(loss):.4f}" if loss is not None else "-"
        if self._bar is not None:
            self._bar.update(1)
            if self.steps % 10 == 0 or self.steps == self.total_steps:
                self._bar.set_postfix_str(
                    f"loss {loss_text} | {self.samples_per_sec:.0f} samples/s "
                    f"({self.samples_per_sec_per_replica:.0f}/replica)"
                )
        elif self.steps % self.log_every == 0 or self.steps == self.total_steps:
            print(
                f"{self.desc} step {self.strategy.global_step}/{self.total_steps}  loss {loss_text}  "
                f"{self.samples_per_sec:.0f} samples/s total  {self.samples_per_sec_per_replica:.0f} samples/s/replica",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
