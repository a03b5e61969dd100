"""Where a ps worker stands in its files, from what the ps tasks counted: its clock, and the clocks of the
workers of a checkpoint that the job was restored from onto another number of workers.

The data layer turns that into the batches the worker reads (`data/file_regroup.py`); this module only
gathers the counts from every ps task and converts pushes to batches.
"""

from __future__ import annotations

from typing import Sequence, Tuple

from towerflow.data.file_regroup import Handover, Resume
from towerflow.errors import ParameterServerError
from towerflow.ps.messages import EarlierWorkers, Rejoined


def merge_earlier(rejoined: Sequence[Rejoined]) -> Tuple[EarlierWorkers, ...]:
    """The ps tasks' earlier worker counts as one: each old worker's clock is the most any ps task counted (a
    checkpoint's ps tasks may have counted one push apart, as for the current clocks)."""
    views = [r.earlier for r in rejoined]
    shapes = sorted({tuple(e.num_workers for e in v) for v in views})
    if len(shapes) > 1:
        raise ParameterServerError(
            f"the ps tasks were restored from checkpoints of different worker counts ({shapes}): restore every ps "
            "task from the same checkpoint (the chief does, from its logdir)")
    return tuple(EarlierWorkers(gen[0].num_workers, tuple(max(c) for c in zip(*(e.clocks for e in gen))))
                 for gen in zip(*views))


def resume_point(rejoined: Sequence[Rejoined], pushes: int, local_steps: int) -> Resume:
    """The worker's batches trained since the last restore onto another worker count (`pushes` when this
    worker knows them, else the most any ps task counted) and the earlier workers', `local_steps` batches a
    push."""
    pushes = pushes or max((r.pushes for r in rejoined), default=0)
    earlier = merge_earlier(rejoined)
    return Resume(pushes * local_steps,
                  tuple(Handover(e.num_workers, tuple(c * local_steps for c in e.clocks)) for e in earlier))
