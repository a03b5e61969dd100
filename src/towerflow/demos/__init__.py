"""Demos shipped with the package, so `towerflow demo` works without the repository."""
