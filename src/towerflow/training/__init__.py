"""Training-loop conveniences on top of a strategy: step, progress, evaluation, seeds, schedules."""

from towerflow.training.evaluate import evaluate
from towerflow.training.progress import Progress
from towerflow.training.records import save_metrics
from towerflow.training.schedules import cosine_decay, exponential_decay, piecewise_constant
from towerflow.training.seed import set_seed
from towerflow.training.step import train_step

__all__ = [
    "Progress",
    "cosine_decay",
    "evaluate",
    "exponential_decay",
    "piecewise_constant",
    "save_metrics",
    "set_seed",
    "train_step",
]
