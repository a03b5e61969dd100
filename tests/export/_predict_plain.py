"""Loads an export into PlainNet in a process without towerflow and saves its predictions (argv: EXPORT OUT)."""

import sys

import torch

from _plain_net import PlainNet, records

export, out = sys.argv[1], sys.argv[2]
hashed = None
if len(sys.argv) > 3 and sys.argv[3] == "--hash":
    sys.path.insert(0, export)
    from hash_lookup import HashTableLookup

    hashed = HashTableLookup.load(export, "hashed", mode="sum")
model = PlainNet(hashed)
model.load_state_dict(torch.load(f"{export}/model.pt"))
model.eval()
dense, ids, hash_ids, _ = records(300, seed=99)
with torch.no_grad():
    torch.save(model(dense, ids, hash_ids), out)
assert not [m for m in sys.modules if m.startswith("towerflow")], "towerflow was imported"
print("towerflow imported: no")
