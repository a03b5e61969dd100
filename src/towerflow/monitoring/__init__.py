"""Monitoring: GPU and host statistics (`towerflow smi`), and views of running jobs."""
