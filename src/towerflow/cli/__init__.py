"""The `towerflow` command: one module per subcommand, each adding its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# Subcommand modules, each with `register(subparsers)` that sets `func` on its parser.
SUBCOMMANDS = ("towerflow.cli.devices", "towerflow.cli.demo", "towerflow.cli.launch", "towerflow.cli.smi", "towerflow.cli.top", "towerflow.cli.report", "towerflow.cli.cluster", "towerflow.cli.data", "towerflow.cli.export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towerflow", description="TensorFlow-style devices, clusters and parallel training for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
