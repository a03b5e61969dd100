"""The README's example: one script for every scale; only the launch line changes.

    python examples/quickstart.py                                   # one device (first GPU, else CPU)
    towerflow launch --nproc 2 examples/quickstart.py               # two replicas on this machine, all-reduce
    towerflow launch --workers 2 examples/quickstart.py             # two workers (one per host on a cluster)
    towerflow launch --ps 1 --workers 2 examples/quickstart.py      # parameter server, async updates
"""
import torch
import torch.nn.functional as F

import towerflow
from towerflow.data import load_mnist_or_digits

strategy = towerflow.strategy_from_env()  # picked from the environment the launch line sets up
data = load_mnist_or_digits(None)  # scikit-learn's 8x8 digits; give a folder for MNIST-t10k
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
model, optimizer = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=3e-3))
train = strategy.distribute_loader(data.train, global_batch_size=64)  # each replica reads its own shard
for step, (x, y) in zip(range(400), train.forever()):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # all-reduce, or push to / pull from the ps tasks
test = strategy.distribute_loader(data.test, global_batch_size=360, shuffle=False)
strategy.print(f"test accuracy: {towerflow.evaluate(strategy, model, test)['accuracy']:.4f}")
strategy.shutdown()
