"""A batch of records keyed by feature name: the dense features, each categorical's ids, each list's bags.

Stored column-wise as the model consumes it: the dense features as one float32 matrix (schema order),
the one-id categoricals as one int64 matrix (so Criteo's 26 are one tensor), each list column as its ids
and each record's count of them, the labels as float32. The stream shuffles, cuts and joins batches
(`take`, `slice`, `cat`); a model reads `batch["userid"]` (ids [B]) or `batch["clicked"]` (ids and
offsets, as `nn.EmbeddingBag` takes them).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Sequence, Tuple, Union

import torch

from towerflow.errors import DataError


@dataclasses.dataclass(frozen=True)
class FeatureNames:
    """The names behind a batch's columns: one object shared by every batch of a stream."""

    dense: Tuple[str, ...]
    ids: Tuple[str, ...]
    lists: Tuple[str, ...]
    tables: Dict[str, str]  # feature -> the table it feeds

    @classmethod
    def of(cls, schema) -> "FeatureNames":
        return cls(tuple(c.name for c in schema.dense), tuple(c.name for c in schema.categoricals),
                   tuple(c.name for c in schema.lists),
                   {c.name: c.table_name for c in (*schema.categoricals, *schema.lists)})


@dataclasses.dataclass
class Features:
    """One batch: `dense` float32 [B, D], `ids` int64 [B, K], `bags` (ids, counts) per list column, `labels` [B]."""

    names: FeatureNames
    dense: torch.Tensor
    ids: torch.Tensor
    bags: Tuple[Tuple[torch.Tensor, torch.Tensor], ...]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, name: str) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """A categorical's ids [B], or a list column's (ids, offsets) for `nn.EmbeddingBag`."""
        if name in self.names.ids:
            return self.ids[:, self.names.ids.index(name)]
        if name in self.names.lists:
            values, counts = self.bags[self.names.lists.index(name)]
            return values, _starts(counts)
        if name in self.names.dense:
            return self.dense[:, self.names.dense.index(name)]
        raise DataError(f"no feature {name!r} in this batch: it has {', '.join(self.features())}")

    def features(self) -> List[str]:
        return [*self.names.dense, *self.names.ids, *self.names.lists]

    def categorical(self) -> Iterator[Tuple[str, Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]]]:
        """(name, ids or (ids, offsets)) of every categorical and list column, in schema order."""
        for name in (*self.names.ids, *self.names.lists):
            yield name, self[name]

    def as_tuple(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dense, ids, labels): the batches of Criteo's layout as they have always been handed out."""
        if self.bags:
            raise DataError(f"a batch with list columns {list(self.names.lists)} has no (dense, cats, labels) form")
        return self.dense, self.ids, self.labels

    def to(self, device, non_blocking: bool = False) -> "Features":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Features(self.names, move(self.dense), move(self.ids),
                        tuple((move(v), move(c)) for v, c in self.bags), move(self.labels))

    # ---- what the stream does with batches
    def take(self, order: torch.Tensor) -> "Features":
        """The records at `order` (a permutation, or any index)."""
        bags = []
        for values, counts in self.bags:
            picked = counts[order]
            starts = _starts(counts)[order]
            shift = torch.repeat_interleave(starts - _starts(picked), picked)
            bags.append((values[shift + torch.arange(len(shift))], picked))
        return Features(self.names, self.dense[order], self.ids[order], tuple(bags), self.labels[order])

    def slice(self, start: int, stop: int) -> "Features":
        bags = []
        for values, counts in self.bags:
            first = int(counts[:start].sum())
            bags.append((values[first:first + int(counts[start:stop].sum())], counts[start:stop]))
        return Features(self.names, self.dense[start:stop], self.ids[start:stop], tuple(bags), self.labels[start:stop])

    @staticmethod
    def cat(batches: Sequence["Features"]) -> "Features":
        if len(batches) == 1:
            return batches[0]
        first = batches[0]
        bags = tuple((torch.cat([b.bags[i][0] for b in batches]), torch.cat([b.bags[i][1] for b in batches]))
                     for i in range(len(first.bags)))
        return Features(first.names, torch.cat([b.dense for b in batches]), torch.cat([b.ids for b in batches]), bags,
                        torch.cat([b.labels for b in batches]))

    @classmethod
    def from_tuple(cls, names: FeatureNames, dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> "Features":
        """A batch of a layout without list columns from its three tensors (synthetic data, a held-out set)."""
        return cls(names, dense, ids, (), labels)


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """Each bag's first position among the ids: the exclusive running sum of the counts."""
    out = torch.zeros_like(counts)
    if len(counts) > 1:
        torch.cumsum(counts[:-1], 0, out=out[1:])
    return out

