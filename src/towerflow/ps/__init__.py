"""Parameter-server training: variable layout on ps tasks, the update policies, the ps-side service."""

from towerflow.ps.layout import Layout, ShardSpec, plan_layout

__all__ = ["Layout", "ShardSpec", "plan_layout"]
