"""`towerflow launch`: start a cluster's tasks on this machine (embedded) or one task of a multi-host cluster."""

from towerflow.launch.local import LaunchPlan, plan_local, plan_one
from towerflow.launch.supervisor import Supervisor, TaskFailure, TaskProcessSpec

__all__ = ["LaunchPlan", "Supervisor", "TaskFailure", "TaskProcessSpec", "plan_local", "plan_one"]
