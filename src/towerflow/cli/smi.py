"""`towerflow smi [--watch S] [--json]`: GPUs at a glance, like gpustat or `watch -n 1 nvidia-smi`."""

from __future__ import annotations


def _positive(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--watch {text!r}: expected seconds, e.g. 1 or 0.5") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--watch {text!r}: expected a positive number of seconds")
    return value


def register(sub) -> None:
    p = sub.add_parser("smi", help="GPU temperature, utilization, memory, power and processes (or CPU/RAM)")
    p.add_argument("--watch", "-n", type=_positive, metavar="SECONDS", help="refresh in place every SECONDS until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    colour = p.add_mutually_exclusive_group()
    colour.add_argument("--color", dest="colour", action="store_true", default=None, help="force colour")
    colour.add_argument("--no-color", dest="colour", action="store_false", help="never colour")
    p.set_defaults(func=run)


def run(args) -> int:
    from towerflow.monitoring.smi import run as smi

    return smi(watch=args.watch, as_json=args.json, colour=args.colour)
