"""Names of the files towerflow writes into a log directory, in one place."""

CHECKPOINT_GLOB = "ckpt-*.json"  # one manifest per checkpoint; the manifest is what makes it count


def checkpoint_file(step: int) -> str:
    return f"ckpt-{step:010d}.pt"


def manifest_file(step: int) -> str:
    return f"ckpt-{step:010d}.json"


METRICS_FILE = "metrics.jsonl"  # JSON lines appended by every task; read by `towerflow top` / `report`
RESULTS_FILE = "metrics.json"  # a run's final numbers (accuracy, global step, samples/s), written once at the end
