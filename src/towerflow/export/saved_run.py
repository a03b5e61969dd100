"""A run's checkpoint read back as whole variables and table shards, whatever layout wrote it.

A parameter-server checkpoint keeps what each ps task held: flat buffers of its dense shards (named in
`shards`, in buffer order) and each table's shard with its `TableSpec`. The layout that cut them is
rebuilt from those names and the shapes the manifest records, so neither the placement nor the
partition of the training job needs to be known. The payload is memory-mapped: a table shard is paged
in only when read, and a caller that reads shard after shard never holds a whole table.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from towerflow.errors import CheckpointError
from towerflow.ps.layout import Layout, ShardSpec
from towerflow.ps.tables import TableSpec
from towerflow.session.checkpoint import CheckpointInfo, CheckpointManager

_PART = re.compile(r"^(?P<variable>.*)/part_(?P<shard>\d+)$")


@dataclasses.dataclass(frozen=True)
class TableShard:
    """One saved shard of one table: its values (a view of the mapped checkpoint) and, for a hash table, its ids
    (a fixed table's global ids are made a chunk at a time by `chunks`, never for the whole shard)."""

    spec: TableSpec
    shard: int
    values: torch.Tensor
    hash_ids: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    def chunks(self, chunk_rows: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """(global ids, values) of `chunk_rows` rows at a time (the values views of the mapped checkpoint)."""
        for start in range(0, self.rows, chunk_rows):
            end = min(self.rows, start + chunk_rows)
            ids = (self.hash_ids[start:end] if self.hash_ids is not None else
                   self.spec.global_ids(self.shard, torch.arange(start, end, dtype=torch.int64)))
            yield ids, self.values[start:end]


class SavedRun:
    """One checkpoint of a run, opened for export."""

    def __init__(self, info: CheckpointInfo, payload: dict):
        self.info = info
        self.step = int(payload.get("step", info.step))
        self.model_state: Dict[str, torch.Tensor] = dict(payload.get("model") or {})
        optimizer = payload.get("optimizer")
        self.parts: List[dict] = []
        if isinstance(optimizer, dict) and isinstance(optimizer.get("ps"), dict):
            ps = optimizer["ps"]
            self.parts = [ps[k] for k in sorted(ps, key=int)]

    @property
    def num_ps(self) -> int:
        """ps tasks that wrote this checkpoint (0: a run without parameter servers)."""
        return len(self.parts)

    # ---- dense variables
    def layout(self) -> Layout:
        """The dense layout the parts were written with, rebuilt from their shard names."""
        counts: Dict[str, int] = {}
        for part in self.parts:
            for name in part["shards"]:
                m = _PART.match(name)
                variable = m.group("variable") if m else name
                counts[variable] = counts.get(variable, 0) + 1
        shards, variables = [], {}
        for task, part in enumerate(self.parts):
            offsets: Dict[torch.dtype, int] = {}
            for name in part["shards"]:
                m = _PART.match(name)
                variable, index = (m.group("variable"), int(m.group("shard"))) if m else (name, 0)
                if variable not in self.model_state:
                    raise CheckpointError(f"{self.info.path}: ps task {task} holds {name!r}, which the checkpoint's model "
                                          f"state does not name (it has {sorted(self.model_state)[:8]}...); it was not "
                                          "written by towerflow's MonitoredTrainingSession / CheckpointManager")
                whole = self.model_state[variable]
                shape, dtype, n = tuple(whole.shape), whole.dtype, counts[variable]
                lo, hi = _row_range(shape[0], n, index) if n > 1 else (0, shape[0] if shape else 1)
                shard_shape = ((hi - lo),) + shape[1:] if n > 1 else shape
                spec = ShardSpec(variable, index, n, task, lo, hi, shard_shape, dtype, offsets.get(dtype, 0))
                offsets[dtype] = spec.offset + spec.numel
                shards.append(spec)
                variables[variable] = (shape, dtype)
        return Layout(shards, len(self.parts), "saved", variables)

    def dense_values(self) -> Dict[str, torch.Tensor]:
        """Every dense variable as the ps tasks held it (the newest values, not the chief's last pull)."""
        if not self.parts:
            return {}
        layout = self.layout()
        by_shard: Dict[str, torch.Tensor] = {}
        for task, part in enumerate(self.parts):
            dtypes = list(layout.flat_sizes(task))
            if len(dtypes) != len(part["values"]):
                raise CheckpointError(f"{self.info.path}: ps task {task} saved {len(part['values'])} flat buffers for "
                                      f"{len(dtypes)} dtypes of its shards {part['shards']}")
            by_shard.update(layout.unpack(task, dict(zip(dtypes, part["values"]))))
        return {v: layout.assemble(v, [by_shard[s.name] for s in layout.shards_of(v)]) for v in layout.variables}

    # ---- tables
    def table_specs(self) -> Dict[str, TableSpec]:
        """Every table the ps tasks held, by name (the module's name in the model)."""
        specs: Dict[str, TableSpec] = {}
        for part in self.parts:
            for name, entry in (part.get("tables") or {}).items():
                specs.setdefault(name, entry["spec"])
        return specs

    def table_shards(self, name: str) -> Iterator[TableShard]:
        """The table's shards in order, each read when reached (a hash table's rows are its live ids)."""
        for task, part in enumerate(self.parts):
            entry = (part.get("tables") or {}).get(name)
            if entry is None:
                raise CheckpointError(f"{self.info.path}: ps task {task} saved no shard of table {name!r}")
            spec, shard, state = entry["spec"], int(entry["shard"]), entry["state"]
            if spec.is_hash:
                yield TableShard(spec, shard, state["values"], state["ids"].long())
            else:
                yield TableShard(spec, shard, state["values"])


def _row_range(rows: int, n: int, index: int) -> Tuple[int, int]:
    """Rows of shard `index` of `n` (the first rows % n one longer: TF's partitioned variables, layout.py)."""
    base, extra = divmod(rows, n)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def open_run(run_dir: str, step: Optional[int] = None) -> SavedRun:
    """The newest intact checkpoint of `run_dir` (or the one of `step`), memory-mapped."""
    manager = CheckpointManager(run_dir)
    found = manager.checkpoints()
    if step is None:
        info = manager.latest()
        if info is None:
            raise CheckpointError(f"{run_dir!r} holds no intact checkpoint (ckpt-*.json with its payload): give the "
                                  "--logdir of a run that saved checkpoints (save_checkpoint_steps / _secs)")
    else:
        matches = [c for c in found if c.step == step]
        if not matches:
            raise CheckpointError(f"{run_dir!r} has no checkpoint of step {step}; it has steps "
                                  f"{[c.step for c in found]}: pick one of them, or leave the step out for the newest")
        info = matches[0]
        problem = manager.problem(info)
        if problem is not None:
            raise CheckpointError(f"checkpoint {info.path} (step {step}) is unusable: {problem}; pick another step")
    payload = torch.load(info.path, map_location="cpu", weights_only=False, mmap=True)
    return SavedRun(info, payload)
