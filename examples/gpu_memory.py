"""Seed 000/003: GPU visibility and memory.  Run: python examples/gpu_memory.py [--fraction 0.4] [--no-growth]

TF's `config.gpu_options.allow_growth = True` / `per_process_gpu_memory_fraction = 0.4` and
CUDA_VISIBLE_DEVICES, carried over unchanged. On a machine without a GPU the options are
accepted (the same script runs everywhere) and the script says there is nothing to apply them to.
"""

import argparse

import torch

import towerflow

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--fraction", type=float, default=0.4, help="per_process_gpu_memory_fraction")
parser.add_argument("--no-growth", action="store_true", help="allow_growth=False: reserve the memory up front")
parser.add_argument("--visible", default=None, help="visible_device_list, e.g. '0' or '1,0'")
args = parser.parse_args()

config = towerflow.Config()
config.gpu_options.allow_growth = not args.no_growth
config.gpu_options.per_process_gpu_memory_fraction = args.fraction
if args.visible is not None:
    config.gpu_options.visible_device_list = args.visible  # must come before any GPU work
towerflow.configure(config)
print(towerflow.device_mapping())

if not towerflow.is_gpu_available():
    print("no GPU here: the memory options are kept and apply to no device")
else:
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"cap: {args.fraction:.0%} of {total >> 20} MiB = {int(args.fraction * total) >> 20} MiB per GPU")
    print(f"reserved up front: {torch.cuda.memory_reserved(0) >> 20} MiB (allow_growth={not args.no_growth})")
    try:
        with towerflow.device("/gpu:0"):
            torch.empty(int(total * min(1.0, args.fraction + 0.1)), dtype=torch.uint8)
        print("allocated past the cap?! (PyTorch did not enforce it)")
    except torch.cuda.OutOfMemoryError:
        print("an allocation past the cap fails with OutOfMemoryError, as TF's would")
