"""`towerflow demo`: the tour `make demo` runs (for now the placement layer; the cluster demo comes with the training issues)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the towerflow demo")
    p.set_defaults(func=run)


def run(args) -> int:
    from towerflow.demos.placement import main

    return main()
