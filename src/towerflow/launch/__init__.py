"""`towerflow launch`: start a cluster's tasks on this machine (embedded) or one task of a multi-host cluster."""

from towerflow.launch.local import LaunchPlan, plan_local, plan_one
from towerflow.launch.supervisor import Supervisor
from towerflow.launch.task_process import TaskProcessSpec
from towerflow.launch.verdict import Verdict

__all__ = ["LaunchPlan", "Supervisor", "TaskProcessSpec", "Verdict", "plan_local", "plan_one"]
