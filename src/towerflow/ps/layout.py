"""Which parameter-server task holds which variable, or which rows of it.

TF 1.x placed variables on ps tasks with `replica_device_setter`: round-robin per variable
by default, or a greedy load balancer by bytes; a large variable (an embedding table) was
split by rows into a partitioned variable whose parts were placed like separate variables.
`plan_layout` does the same, and returns a `Layout` that every task computes identically
(it depends only on names, shapes and dtypes), so no one has to send it around.

Every shard also gets an offset in its task's flat buffer of its dtype: the ps keeps one
contiguous tensor per dtype and the worker pushes and pulls that tensor whole, so a push
is one message per ps task, not one per variable.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple, Union

import torch

from towerflow.errors import LayoutError, did_you_mean

PLACEMENTS = ("round_robin", "greedy")

# partition=: None (no partitioning), bytes (split tensors at least this big across every ps
# task), {name: num_shards}, or a callable (name, shape, dtype) -> num_shards (TF's partitioner)
Partition = Union[None, int, Mapping[str, int], Callable[[str, Tuple[int, ...], torch.dtype], int]]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """One piece of one variable on one ps task: rows [row_start, row_stop) of dim 0, or all of it."""

    variable: str
    shard: int
    num_shards: int
    task: int
    row_start: int
    row_stop: int
    shape: Tuple[int, ...]  # this shard's shape
    dtype: torch.dtype
    offset: int = 0  # element offset in its task's flat buffer of `dtype`

    @property
    def name(self) -> str:
        """`emb/part_1` for a part of a partitioned variable (TF's naming), else the variable's name."""
        return self.variable if self.num_shards == 1 else f"{self.variable}/part_{self.shard}"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def is_partitioned(self) -> bool:
        return self.num_shards > 1


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Layout:
    """The placement of every variable's shards on `num_ps` ps tasks; print it to see the plan."""

    def __init__(self, shards: Sequence[ShardSpec], num_ps: int, placement: str,
                 variables: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]]):
        self.shards: Tuple[ShardSpec, ...] = tuple(shards)
        self.num_ps = num_ps
        self.placement = placement
        self.variables: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = dict(variables)
        self._by_variable: Dict[str, List[ShardSpec]] = {}
        for s in self.shards:
            self._by_variable.setdefault(s.variable, []).append(s)

    # ---- queries
    def shards_of(self, variable: str) -> List[ShardSpec]:
        """The shards of one variable, in row order."""
        if variable not in self._by_variable:
            raise LayoutError(
                f"variable {variable!r} is not in this layout; it has {sorted(self._by_variable)}"
                f"{did_you_mean(variable, self._by_variable)}"
            )
        return self._by_variable[variable]

    def on_task(self, task: int) -> List[ShardSpec]:
        """The shards ps task `task` holds, in flat-buffer order."""
        return [s for s in self.shards if s.task == task]

    def bytes_per_task(self) -> List[int]:
        out = [0] * self.num_ps
        for s in self.shards:
            out[s.task] += s.nbytes
        return out

    def flat_sizes(self, task: int) -> Dict[torch.dtype, int]:
        """Elements per dtype in task `task`'s flat buffers (the sizes of what is pushed and pulled)."""
        out: Dict[torch.dtype, int] = {}
        for s in self.on_task(task):
            out[s.dtype] = out.get(s.dtype, 0) + s.numel
        return out

    @property
    def tasks_used(self) -> List[int]:
        return sorted({s.task for s in self.shards})

    # ---- splitting and reassembling values
    def split(self, variable: str, value: torch.Tensor) -> List[torch.Tensor]:
        """`value` cut into this variable's shards (views, no copy)."""
        shape, _ = self.variables.get(variable, (None, None))
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise LayoutError(f"{variable!r} has shape {tuple(shape)} in the layout, got a value of shape {tuple(value.shape)}")
        shards = self.shards_of(variable)
        if len(shards) == 1:
            return [value]
        return [value[s.row_start:s.row_stop] for s in shards]

    def assemble(self, variable: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole variable from its shards' values (the inverse of `split`)."""
        shards = self.shards_of(variable)
        if len(parts) != len(shards):
            raise LayoutError(f"{variable!r} has {len(shards)} shards, got {len(parts)} parts")
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), 0)

    def pack(self, task: int, values: Mapping[str, torch.Tensor]) -> Dict[torch.dtype, torch.Tensor]:
        """Task `task`'s flat buffers (one per dtype) filled from whole-variable values (CPU copies)."""
        parts: Dict[torch.dtype, List[torch.Tensor]] = {}
        for s in self.on_task(task):
            value = values[s.variable]
            piece = value[s.row_start:s.row_stop] if s.is_partitioned else value
            parts.setdefault(s.dtype, []).append(piece.detach().reshape(-1).to("cpu"))
        return {d: torch.cat(p) for d, p in parts.items()}

    def unpack(self, task: int, flats: Mapping[torch.dtype, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Shard name -> its value, as views of task `task`'s flat buffers."""
        return {s.name: flats[s.dtype][s.offset:s.offset + s.numel].view(s.shape) for s in self.on_task(task)}

    # ---- printing
    def table(self) -> str:
        """One line per shard (variable, shard, task, rows, shape, bytes), then bytes per task."""
        rows = [("variable", "shard", "task", "rows", "shape", "dtype", "bytes")]
        for s in self.shards:
            rows.append((
                s.variable,
                f"{s.shard}/{s.num_shards}",
                f"/job:ps/task:{s.task}",
                f"{s.row_start}:{s.row_stop}" if s.is_partitioned else "all",
                "x".join(map(str, s.shape)) or "scalar",
                str(s.dtype).replace("torch.", ""),
                f"{s.nbytes:,}",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"layout: {len(self.variables)} variables in {len(self.shards)} shards on {self.num_ps} ps tasks "
                 f"({self.placement})"]
        for r in rows:
            lines.append("  ".join(c.rjust(w) if i == len(r) - 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        for t, b in enumerate(self.bytes_per_task()):
            lines.append(f"/job:ps/task:{t}: {sum(1 for s in self.shards if s.task == t)} shards, {b:,} bytes")
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return f"Layout({len(self.shards)} shards on {self.num_ps} ps tasks, {self.placement}, bytes {self.bytes_per_task()})"


def _normalize(variables) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    items = variables.items() if isinstance(variables, Mapping) else variables
    out = []
    seen = set()
    for name, value in items:
        if isinstance(value, torch.Tensor):
            shape, dtype = tuple(value.shape), value.dtype
        else:
            try:
                shape, dtype = tuple(int(d) for d in value[0]), value[1]
            except (TypeError, IndexError, ValueError):
                raise LayoutError(
                    f"variable {name!r}: expected a tensor or a (shape, dtype) pair, got {value!r}"
                ) from None
        if name in seen:
            raise LayoutError(f"variable {name!r} appears twice; variable names must be unique")
        seen.add(name)
        out.append((name, shape, dtype))
    return out


def _num_shards(partition: Partition, name: str, shape: Tuple[int, ...], dtype: torch.dtype, num_ps: int) -> int:
    if partition is None:
        return 1
    if isinstance(partition, bool):
        raise LayoutError(f"partition={partition!r}: expected None, a byte threshold, {{name: shards}} or a callable")
    if isinstance(partition, int):
        nbytes = _itemsize(dtype)
        for s in shape:
            nbytes *= s
        wanted = num_ps if shape and nbytes >= partition else 1
    elif isinstance(partition, Mapping):
        wanted = int(partition.get(name, 1))
    elif callable(partition):
        wanted = int(partition(name, shape, dtype))
    else:
        raise LayoutError(f"partition={partition!r}: expected None, a byte threshold, {{name: shards}} or a callable")
    if wanted < 1:
        raise LayoutError(f"variable {name!r}: {wanted} shards asked for; expected at least 1")
    if wanted > 1 and not shape:
        raise LayoutError(f"variable {name!r} is a scalar and cannot be split into {wanted} shards; partition tensors with rows")
    return min(wanted, shape[0]) if shape else 1


def _row_ranges(rows: int, n: int) -> List[Tuple[int, int]]:
    """n contiguous ranges; the first rows % n get one row more (TF's partitioned variables)."""
    base, extra = divmod(rows, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def plan_layout(variables, num_ps: int, placement: str = "round_robin", partition: Partition = None) -> Layout:
    """Place every variable (or each of its row shards) on one of `num_ps` ps tasks.

    `variables`: {name: tensor} or [(name, tensor)] (meta tensors or (shape, dtype) pairs work:
    only shapes and dtypes are read). `placement`: 'round_robin' (TF's replica_device_setter:
    the i-th shard, in order, goes to task i mod num_ps) or 'greedy' (largest shard first onto
    the task with the fewest bytes so far; ties go to the lower task). `partition`: see `Partition`.
    """
    if not isinstance(num_ps, int) or num_ps < 1:
        raise LayoutError(f"num_ps={num_ps!r}: expected a positive number of ps tasks (launch with --ps N)")
    if placement not in PLACEMENTS:
        raise LayoutError(f"placement={placement!r}: expected one of {PLACEMENTS}{did_you_mean(str(placement), PLACEMENTS)}")
    normalized = _normalize(variables)
    units = []  # (variable, shard, num_shards, rows, shape, dtype) in creation order
    for name, shape, dtype in normalized:
        n = _num_shards(partition, name, shape, dtype, num_ps)
        ranges = _row_ranges(shape[0], n) if n > 1 else [(0, shape[0] if shape else 1)]
        for i, (lo, hi) in enumerate(ranges):
            units.append((name, i, n, lo, hi, ((hi - lo),) + shape[1:] if n > 1 else shape, dtype))
    tasks: List[int] = [0] * len(units)
    if placement == "round_robin":
        tasks = [i % num_ps for i in range(len(units))]
    else:
        load = [0] * num_ps
        nbytes = [_itemsize(u[6]) * _prod(u[5]) for u in units]
        for i in sorted(range(len(units)), key=lambda i: -nbytes[i]):
            t = min(range(num_ps), key=lambda t: (load[t], t))
            tasks[i] = t
            load[t] += nbytes[i]
    offsets: Dict[Tuple[int, torch.dtype], int] = {}
    shards = []
    for (name, i, n, lo, hi, shape, dtype), t in zip(units, tasks):
        off = offsets.get((t, dtype), 0)
        spec = ShardSpec(name, i, n, t, lo, hi, tuple(shape), dtype, off)
        offsets[(t, dtype)] = off + spec.numel
        shards.append(spec)
    return Layout(shards, num_ps, placement, {name: (shape, dtype) for name, shape, dtype in normalized})


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
