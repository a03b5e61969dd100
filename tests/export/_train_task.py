"""A chief or worker of the export tests: trains PlainNet with its tables on the ps tasks (or restores a checkpoint
onto this job's ps tasks), then the chief waits for the workers, checkpoints and saves its predictions."""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import towerflow
from _plain_net import DIM, PlainNet, records

p = argparse.ArgumentParser()
p.add_argument("--logdir", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--hash", action="store_true")
p.add_argument("--placement", default="round_robin")
p.add_argument("--partition", type=int, default=None, help="row-shard dense variables of at least these bytes")
p.add_argument("--partition-strategy", default="mod")
p.add_argument("--restore-from", default=None)
args = p.parse_args()

torch.manual_seed(0)
strategy = towerflow.ParameterServerStrategy(placement=args.placement, partition=args.partition,
                                             partition_strategy=args.partition_strategy)
hashed = towerflow.ps.HashEmbedding(DIM, mode="sum", init_std=0.1) if args.hash else None
model = PlainNet(hashed, table_device=strategy.table_device)
model, optimizer = strategy.setup(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                  sparse_optimizer=towerflow.ps.SparseAdagrad(lr=0.1))
if args.restore_from:
    restored = towerflow.CheckpointManager(args.restore_from).restore(model, optimizer)
    assert restored is not None, args.restore_from
for step in range(args.steps):
    dense, ids, hash_ids, labels = records(64, seed=1000 * strategy.replica_id + step)
    optimizer.zero_grad()
    F.binary_cross_entropy_with_logits(model(dense, ids, hash_ids), labels).backward()
    optimizer.step()
if strategy.is_chief:
    step = strategy.wait_for_workers()
    towerflow.CheckpointManager(args.logdir).save(step, model, optimizer)
    dense, ids, hash_ids, _ = records(300, seed=99)
    with torch.no_grad():
        torch.save(model(dense, ids, hash_ids), os.path.join(args.logdir, "predictions.pt"))
    print(f"saved step {step}", flush=True)
strategy.shutdown()
