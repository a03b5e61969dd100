"""What the file-fed tasks of these tests share: the model and its Parquet stream, and one step whose batch's
record ids (column C1; table 0 is as large as the ids) are logged as a line once the step is trained."""

import torch
import torch.nn.functional as F
from torch import nn

ROWS = [1 << 20] + [1000] * 25


def setup(strategy, data: str):
    """(model, optimizer, stream) for this worker: a seeded linear model, SGD, its share of the files."""
    torch.manual_seed(0)
    model = nn.Linear(13, 1)
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    return model, optimizer, strategy.distribute_files(data, "parquet", 32, ROWS, shuffle_window=128, seed=3)


def train_logged(session, model, optimizer, batch, log) -> None:
    """Train one step on `batch` in `session`, then append its record ids to `log`."""
    dense, cats, labels = batch
    device = next(model.parameters()).device  # the stream's batches stay on the host
    dense, labels = dense.to(device), labels.to(device)

    def step():
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(dense).squeeze(1), labels).backward()
        optimizer.step()

    session.run(step)
    log.write(" ".join(map(str, cats[:, 0].tolist())) + "\n")
    log.flush()
