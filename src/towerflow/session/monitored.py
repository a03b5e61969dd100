"""MonitoredTrainingSession: TF's training loop supervisor for PyTorch.

    with towerflow.MonitoredTrainingSession(model, optimizer, logdir="runs/mnist",
                                            hooks=[towerflow.StopAtStepHook(last_step=1000)]) as session:
        while not session.should_stop():
            session.run(train_step, next(batches))   # train_step returns the loss

The chief restores the newest checkpoint (or starts fresh), saves checkpoints on a schedule,
and writes summaries; every task writes metrics records and loops until a hook asks to stop.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from towerflow import _log
from towerflow import taskenv as _taskenv
from towerflow.monitoring.accumulator import FlushRule
from towerflow.monitoring.metrics import EVENT_END, EVENT_FAILED, EVENT_START, MetricsWriter
from towerflow.session.checkpoint import CheckpointManager, RestoredState
from towerflow.session.hooks import CheckpointHook, LoggingHook, MetricsHook, NanGuardHook, ProgressHook, SessionHook
from towerflow.session.profiling import ProfilerHook


def task_context(strategy: Any = None) -> _taskenv.TaskContext:
    """The task a session runs in: its strategy's, else this process's running Server's (a script that
    started one, as TF's guides do), else the one its environment names."""
    if strategy is not None:
        return strategy.context
    from towerflow.cluster import server as _server

    running = _server.current()
    return running.context if running is not None else _taskenv.from_environment()


class MonitoredTrainingSession:
    """Runs steps, calls hooks, restores and checkpoints; a context manager."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any = None,
        *,
        logdir: Optional[str] = None,
        strategy: Any = None,
        is_chief: Optional[bool] = None,
        hooks: Iterable[SessionHook] = (),
        save_checkpoint_steps: Optional[int] = None,
        save_checkpoint_secs: Optional[float] = 600,
        keep_checkpoints: int = 5,
        log_step_count_steps: int = 100,
        save_summaries_steps: int = 100,
        metrics_flush: Optional[FlushRule] = FlushRule(),
        nan_guard: bool = True,
        progress: bool = True,
        data_state: Optional[Callable[[], Any]] = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.logdir = logdir
        self.context = task_context(strategy)
        if is_chief is None:  # TF's rule (`taskenv.is_chief_task`)
            is_chief = strategy.is_chief if strategy is not None else self.context.is_chief
        self.is_chief = is_chief
        self.task = f"{self.context.identity.job_name or 'localhost'}:{self.context.identity.task_index or 0}"
        self.checkpoints = CheckpointManager(logdir, keep=keep_checkpoints) if logdir else None
        self.metrics: Optional[MetricsWriter] = None
        self.restored: Optional[RestoredState] = None
        self.last_steps_per_sec: Optional[float] = None
        self._data_state = data_state
        self._step = 0
        self.local_steps = 0  # steps this task ran in this session (the global step may move faster)
        self._stop_requested = False
        hooks = list(hooks)
        if nan_guard:
            hooks.append(NanGuardHook())
        if log_step_count_steps:
            hooks.append(LoggingHook(log_step_count_steps))
        if logdir and (save_checkpoint_steps or save_checkpoint_secs):
            hooks.append(CheckpointHook(save_checkpoint_steps, None if save_checkpoint_steps else save_checkpoint_secs))
        if logdir and metrics_flush is not None:
            hooks.append(MetricsHook(metrics_flush))
        self._tensorboard = bool(save_summaries_steps)  # the metrics records mirrored to LOGDIR/tensorboard
        if progress:
            hooks.append(ProgressHook())
        window = self.context.tuning.profile_from
        if window is not None and not any(isinstance(h, ProfilerHook) for h in hooks):  # towerflow launch --profile-steps
            where = self.context.tuning.logdir or logdir
            hooks.append(ProfilerHook(window, self.context.tuning.profile_steps or 10,
                                      os.path.join(where, "profile") if where else None))
        self.hooks: List[SessionHook] = [h for h in hooks if h.runs_on == "all" or self.is_chief]

    # ---- the global step lives in the strategy when there is one (its optimizer counts)
    @property
    def global_step(self) -> int:
        return self.strategy.global_step if self.strategy is not None else self._step

    def _set_global_step(self, step: int) -> None:
        if self.strategy is not None:
            self.strategy.steps.restore(step)
        else:
            self._step = step

    def __enter__(self) -> "MonitoredTrainingSession":
        if self.logdir:
            device = getattr(self.strategy, "device_name", None) or _local_device_name()
            self.metrics = MetricsWriter(self.logdir, self.task, role="chief" if self.is_chief else "worker", device=device,
                                         tensorboard=self._tensorboard)
            self.metrics.write(self.global_step, event=EVENT_START, restarts=self.context.identity.restart_count)
        for hook in self.hooks:
            hook.begin(self)
        if self.checkpoints is not None:
            ps_restored = False
            if self.is_chief and hasattr(self.strategy, "restore_ps_from"):  # (first: it may restore the ps tasks now)
                ps_restored = bool(self.strategy.restore_ps_from(self._newest_shared_state))
            self._restore(ps_restored)
        for hook in self.hooks:
            hook.after_create_session(self)
        return self

    def _restore(self, ps_restored: bool = False) -> None:
        """Restore the newest checkpoint, unless the running state is newer: a restarted chief whose
        ps tasks kept training finds them ahead of any checkpoint. With shared variables (a ps
        strategy) only the chief restores them; the others pull what it restored. `ps_restored`: the
        strategy has just put the ps tasks back to that checkpoint; the rest of it (the data's position)
        is restored here, the ps state not again."""
        if getattr(self.strategy, "shared_variables", False) and not self.is_chief:
            return
        latest = self.checkpoints.latest()
        if latest is None:
            return
        if not ps_restored and self.global_step > 0 and latest.step <= self.global_step:
            _log.get("session", self.task).info(f"kept the running state at global step {self.global_step}; the "
                                                 f"newest checkpoint "
                                                 f"({os.path.basename(latest.path)}, step {latest.step}) is not newer")
            return
        self.restored = self.checkpoints.restore(self.model, None if ps_restored else self.optimizer, latest)
        self._set_global_step(self.restored.step)
        restore_files = getattr(self.strategy, "restore_files_checkpoint", None)
        if restore_files is not None:  # where its files stand, also on another number of workers
            extra = self.restored.extra if isinstance(self.restored.extra, dict) else {}
            restore_files(extra.get("files"), self.restored.step)
        if self.metrics is not None:
            self.metrics.write(self.global_step, event=f"restored {os.path.basename(self.restored.path)}")

    def _newest_shared_state(self):
        """(step, path, optimizer state) of the newest checkpoint: what a lost ps is restored from."""
        found = self.checkpoints.load()
        if found is None:
            return None
        info, payload = found
        if self.metrics is not None:
            self.metrics.write(info.step, event=f"restored the ps tasks from {os.path.basename(info.path)}")
        return info.step, info.path, payload.get("optimizer")

    def run(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One training step: hooks before, `step_fn(*args, **kwargs)`, hooks after with its loss."""
        for hook in self.hooks:
            hook.before_step(self)
        before = self.global_step
        result = step_fn(*args, **kwargs)
        self.local_steps += 1
        # no strategy optimizer counted this step (one with local steps counts only its pushes: it did)
        if self.global_step == before and not getattr(self.optimizer, "has_local_steps", False):
            self._set_global_step(before + 1)
        loss = _as_float(result)
        for hook in self.hooks:
            hook.after_step(self, loss)
        return result

    def should_stop(self) -> bool:
        """A hook asked to stop, or the strategy has finished (a ps worker restarted after it had finished)."""
        return self._stop_requested or bool(getattr(self.strategy, "is_finished", False))

    def request_stop(self) -> None:
        self._stop_requested = True

    def save_checkpoint(self) -> Optional[str]:
        if self.checkpoints is None:
            return None
        data = self._data_state() if self._data_state is not None else {"global_step": self.global_step}
        path = self.checkpoints.save(self.global_step, self.model, self.optimizer, data_state=data,
                                     extra={"files": self._files_checkpoint()})
        if self.metrics is not None:
            self.metrics.write(self.global_step, event=f"checkpoint {os.path.basename(path)}")
        return path

    def _files_checkpoint(self) -> dict:
        keep = getattr(self.strategy, "files_checkpoint", None)
        return keep() if keep is not None else {}

    def extra_metrics(self) -> Dict[str, Any]:
        """Fields a strategy adds to each metrics record (staleness, bytes moved), and device memory."""
        extra = getattr(self.strategy, "metrics", None)
        values = _record_fields(extra()) if callable(extra) else {}
        position = getattr(self.strategy, "data_position", None)
        if callable(position):
            values.update(position())
        device = getattr(self.strategy, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda" and torch.cuda.is_initialized():
            values.setdefault("device_memory_mib", torch.cuda.memory_allocated(device) >> 20)
        return values

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                for hook in self.hooks:
                    hook.end(self)
        finally:
            if self.metrics is not None:
                if exc_type is None:
                    self.metrics.write(self.global_step, local_step=self.local_steps, event=EVENT_END)
                else:
                    self.metrics.write(self.global_step, local_step=self.local_steps, event=EVENT_FAILED,
                                       error=f"{exc_type.__name__}: {exc}"[:300])
                self.metrics.close()


def _local_device_name() -> str:
    """Where a strategy-less session computes: the first GPU, else the CPU (short TF name)."""
    from towerflow.devices import list_devices

    devices = list_devices()
    gpu = next((d for d in devices if d.device_type == "GPU"), None)
    return (gpu or devices[0]).short_name


def _record_fields(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """A strategy's counters in the metrics-file schema: totals over ps tasks, the staleness histogram."""
    out: Dict[str, Any] = {}
    for key in ("bytes_pushed", "bytes_pulled"):
        value = metrics.get(key)
        if value is not None:
            out[key] = sum(value.values()) if isinstance(value, dict) else value
    histogram = metrics.get("staleness_histogram", metrics.get("staleness"))
    if isinstance(histogram, dict):
        out["staleness"] = {str(k): v for k, v in histogram.items()}
    for key in ("pushes_dropped", "mode"):
        if key in metrics:
            out[key] = metrics[key]
    return out


def _as_float(result: Any) -> Optional[float]:
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        return float(result.detach())
    if isinstance(result, (int, float)):
        return float(result)
    return None


