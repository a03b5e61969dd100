"""The Strategy contract every way of training implements, from one device to parameter servers.

A strategy owns three decisions and nothing else: which device this replica computes on,
how the replicas' updates are combined, and which part of the data this replica reads.
User code stays ordinary PyTorch:

    strategy = towerflow.strategy_from_env()
    model, optimizer = strategy.setup(model, optimizer)
    for x, y in strategy.distribute_loader(train_set, global_batch_size=256):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()           # synchronous update; strategy.global_step += 1

Subclasses override `_wrap_model` (how gradients are combined) and may override
`_make_optimizer`, `reduce` and `barrier`. A parameter-server strategy plugs in the same way.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Tuple

import torch
from torch.utils.data import Dataset, IterableDataset

from towerflow import taskenv as _taskenv
from towerflow.data.file_regroup import Resume, StepPositions
from towerflow.devices import logical as _logical
from towerflow.data.loader import DistributedLoader
from towerflow.data.sharding import ShardBatch, ShardSampler
from towerflow.errors import DataError, StrategyError
from towerflow.strategies._optimizer import SyncOptimizer, _HostVariables, move_state_to_params

if TYPE_CHECKING:
    from towerflow.data.file_stream import FileStream

MIXED_PRECISION = {None: None, "no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
VARIABLES_ON = ("device", "cpu")


def task_context(context: Optional[_taskenv.TaskContext]) -> _taskenv.TaskContext:
    """A strategy's task: `context` (its entry point's), else the environment's, read now. As a TF strategy
    starts its task's server, this process's devices are named after the task from then on."""
    context = context if context is not None else _taskenv.from_environment()
    if context.has_task:
        _logical.set_local_task(context.identity.job_name, context.identity.task_index)
    return context


class GlobalStep:
    """TF's global step, owned in one place: every change is an `advance()` (an update was applied:
    the strategy's optimizer, or the session for a step no optimizer counted) or a `restore()`
    (a checkpoint, or the ps tasks, say where training is)."""

    def __init__(self) -> None:
        self._value = 0

    @property
    def value(self) -> int:
        return self._value

    def advance(self) -> int:
        self._value += 1
        return self._value

    def restore(self, step: int) -> None:
        if step < 0:
            raise StrategyError(f"global step {step!r}: expected a non-negative integer")
        self._value = int(step)

    def __repr__(self) -> str:
        return f"GlobalStep({self._value})"


class Strategy:
    """Base class: one replica's view of a synchronous training job."""

    name = "strategy"
    # True when all replicas train one shared copy of the variables held elsewhere (the ps tasks):
    # then the chief alone restores a checkpoint into it, and the others must not.
    shared_variables = False
    # Where to build embedding tables (`nn.EmbeddingBag(..., device=strategy.table_device)`): None here
    # (this process trains them); 'meta' with parameter servers (their rows live on the ps tasks).
    table_device: Optional[str] = None
    # Replicas that read one shard of the data together: the towers of one process
    # (TowersStrategy); the loader shards by process, the towers split its batches.
    towers_per_process = 1
    # The stream of the last `distribute_files` (its position goes into the metrics records); None before.
    file_stream: Optional["FileStream"] = None
    _file_positions = StepPositions()  # restores onto other worker counts (`restore_files_checkpoint`)

    def __init__(
        self,
        device: torch.device,
        device_name: str,
        num_replicas: int = 1,
        replica_id: int = 0,
        variables_on: str = "device",
        mixed_precision: Optional[str] = None,
        context: Optional[_taskenv.TaskContext] = None,
    ):
        if variables_on not in VARIABLES_ON:
            raise StrategyError(f"variables_on={variables_on!r}: expected one of {VARIABLES_ON}")
        if mixed_precision not in MIXED_PRECISION:
            raise StrategyError(
                f"mixed_precision={mixed_precision!r}: expected one of {[k for k in MIXED_PRECISION if k]} or None"
            )
        # this task, as its entry point read it (else its environment, now): what the loop helpers read
        self.context = task_context(context)
        self.device = device
        self.device_name = device_name
        self.num_replicas_in_sync = num_replicas
        self.replica_id = replica_id
        self.variables_on = variables_on
        # Mixed precision is a GPU feature (TF's mixed_float16); on a CPU replica it is a no-op.
        self.autocast_dtype = MIXED_PRECISION[mixed_precision] if device.type == "cuda" else None
        self.steps = GlobalStep()  # the one owner of this replica's global step
        self._optimizer: Optional[SyncOptimizer] = None

    @property
    def global_step(self) -> int:
        """TF's global step: updates the model has had (read-only; `steps` advances or restores it)."""
        return self.steps.value

    # ---- who am I
    @property
    def is_chief(self) -> bool:
        """True on the replica that prints, evaluates for the record and writes checkpoints."""
        return self.replica_id == 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(replica {self.replica_id} of {self.num_replicas_in_sync} "
            f"on {self.device_name or self.device}, variables_on={self.variables_on!r})"
        )

    # ---- model and optimizer
    def setup(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr_schedule: Optional[Callable[[int], float]] = None,
        clip_grad_norm: Optional[float] = None,
    ) -> Tuple[torch.nn.Module, Optional[SyncOptimizer]]:
        """Move the model to this replica's device, make its updates synchronous, wrap the optimizer.

        Build the optimizer over `model.parameters()` before calling; it keeps working after
        the move (state it made already, as Adagrad's, moves with the parameters).
        `lr_schedule(global_step) -> lr` is applied before every step;
        `clip_grad_norm` clips the combined gradient (after all-reduce, so every replica agrees).
        Strategies that train embedding tables also take `sparse_optimizer=` (`_local_tables.py`,
        `parameter_server.py`).
        """
        return self._setup_placed(model.to(self.device), optimizer, lr_schedule, clip_grad_norm)

    def _setup_placed(self, model, optimizer, lr_schedule, clip_grad_norm):
        """`setup` for a model already on this replica's device (and an optimizer that covers its tables)."""
        wrapped = self._wrap_model(model)
        if optimizer is None:
            return wrapped, None
        move_state_to_params(optimizer)
        self._optimizer = self._make_optimizer(model, optimizer, lr_schedule, clip_grad_norm)
        return wrapped, self._optimizer

    def _wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def _make_optimizer(self, model, optimizer, lr_schedule, clip_grad_norm) -> SyncOptimizer:
        scaler = None
        if self.autocast_dtype == torch.float16:
            scaler = torch.amp.GradScaler(self.device.type)
        host = None
        if self.variables_on == "cpu":
            host = _HostVariables(list(model.parameters()), optimizer, self._average_on_host)
        return SyncOptimizer(
            optimizer, self, lr_schedule=lr_schedule, clip_grad_norm=clip_grad_norm, scaler=scaler, host_variables=host
        )

    def _average_on_host(self, flat_grads: torch.Tensor) -> None:
        """Average a flat CPU gradient over replicas in place (variables_on='cpu'); one replica: nothing to do."""

    @staticmethod
    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside whatever wrapper `setup` added (for eval, saving, inspection)."""
        return getattr(model, "module", model)

    def _update_threads(self) -> contextlib.AbstractContextManager:
        """Where the optimizer's update runs: as the process is (towers in one process give it every core)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Mixed-precision region for the forward pass (a no-op without mixed precision)."""
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                yield

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, through the fp16 loss scaler when there is one."""
        scaler = self._optimizer.scaler if self._optimizer is not None else None
        (scaler.scale(loss) if scaler is not None else loss).backward()

    # ---- data
    def distribute_loader(
        self,
        dataset: Dataset,
        batch_size: Optional[int] = None,
        global_batch_size: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Optional[Callable] = None,
    ) -> DistributedLoader:
        """This replica's shard of `dataset`, prefetched to its device.

        Give the per-replica `batch_size` or the `global_batch_size` (split evenly, sizes
        differing by at most one). Every sample is read once per epoch across replicas.
        """
        if (batch_size is None) == (global_batch_size is None):
            raise StrategyError(
                f"batch_size={batch_size!r}, global_batch_size={global_batch_size!r}: give exactly one "
                "(batch_size is per replica; global_batch_size is split across the replicas)"
            )
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise DataError(
                f"distribute_loader needs a map-style dataset with a length, got {type(dataset).__name__}: deterministic "
                "sharding indexes it. Wrap the data in a Dataset, or shard an IterableDataset yourself by "
                "strategy.replica_id / strategy.num_replicas_in_sync"
            )
        total = global_batch_size if global_batch_size is not None else batch_size * self.num_replicas_in_sync
        sampler = ShardSampler(
            len(dataset), total, self._num_shards, self.replica_id // self.towers_per_process, shuffle=shuffle, seed=seed,
            drop_last=drop_last,
        )
        return DistributedLoader(
            dataset, sampler, self.device, self.device_name, num_workers=num_workers, collate_fn=collate_fn,
            weigh=self._batch_weight,
        )

    def distribute_files(self, paths, format: Optional[str] = None, batch_size: int = 1024, rows_per_table=None,
                         shuffle_window: int = 0, seed: int = 0, on_bad_record: str = "error", schema=None):
        """This worker's batches of click-log files (`towerflow.data.FileStream`): the files' row groups (or
        text files) dealt round-robin over the workers, shuffled in windows of `shuffle_window` records, read
        ahead by a thread; `batch_size` records per step per process (towers in one process share its files).
        Formats: parquet, arrow, text (CSV, TSV, gzip'd), criteo. With a `schema` (`towerflow.data.Schema`) the
        batches are `Features` keyed by feature name; without one, Criteo's (dense, cats, labels). A worker that starts where training already stands (restarted, or the
        job restored from a checkpoint, also onto another number of workers) starts its files there too:
        `_files_resume()`, asked when the first batch is drawn."""
        from towerflow.data.file_stream import FileStream

        self.file_stream = FileStream(paths, format, batch_size, rows_per_table,
                                      worker=self.replica_id // self.towers_per_process, num_workers=self._num_shards,
                                      shuffle_window=shuffle_window, seed=seed, on_bad_record=on_bad_record,
                                      resume=self._files_resume, schema=schema)
        return self.file_stream

    def data_position(self) -> dict:
        """Where this worker's files stand (the last `distribute_files` stream): epoch, records read in it, and
        the epoch's size where known without reading; {} without a stream. The metrics records carry it."""
        stream = self.file_stream
        if stream is None:
            return {}
        out = {"data_epoch": stream.epoch, "data_records": stream.taken}
        size = stream.epoch_records()
        if size is not None:
            out["data_epoch_records"] = size
        return out

    def _files_resume(self) -> Resume:
        """Where this worker's files stand when its stream starts: one batch per global step since the last
        restore onto another number of workers (and those restores)."""
        return self._file_positions.resume(self._batches_trained())

    def files_checkpoint(self) -> dict:
        """What a checkpoint keeps of the files (MonitoredTrainingSession saves it with every checkpoint): the
        workers that read them and the restores that made their plans."""
        return self._file_positions.state(self._num_shards)

    def restore_files_checkpoint(self, state: Any, step: int) -> None:
        """A checkpoint's `files_checkpoint()` at global step `step`: a job restored onto another number of
        workers reads the old workers' remainders first (docs/data.md)."""
        self._file_positions = StepPositions.restored(state, step, self._num_shards)

    def _batches_trained(self) -> int:
        """Batches this process has trained in the run so far: one per global step when every replica steps
        together (a restored checkpoint sets the step)."""
        return self.global_step

    @property
    def _num_shards(self) -> int:
        return self.num_replicas_in_sync // self.towers_per_process

    def _batch_weight(self, batch: ShardBatch) -> float:
        """This replica's share of a synchronous step's gradient: its samples against an even share."""
        return len(batch.indices) * self._num_shards / batch.global_size

    # ---- collectives (identity on one replica)
    def reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        """`value` combined over all replicas with `op` ('sum', 'mean', 'max', 'min')."""
        if op not in ("sum", "mean", "max", "min"):
            raise StrategyError(f"op={op!r}: expected 'sum', 'mean', 'max' or 'min'")
        return torch.as_tensor(value, dtype=torch.float64).clone()

    def barrier(self) -> None:
        """Wait until every replica gets here."""

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the chief only, so N replicas do not print N copies."""
        if self.is_chief:
            print(*args, **{"flush": True, **kwargs})

    def shutdown(self) -> None:
        """Release what the strategy holds (the process group); safe to call twice."""

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
