"""A task that joins its cluster and then hangs in `wait_here` (a launch of it runs past any deadline)."""

import time

import towerflow

server = towerflow.Server()


def wait_here() -> None:
    time.sleep(600)


wait_here()
