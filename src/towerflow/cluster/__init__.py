"""Clusters: ClusterSpec, Server, remote execution on /job:x/task:y, and the task environment."""

from towerflow.cluster.environment import TaskInfo, read_task
from towerflow.cluster.remote import RemoteFuture, function, remote
from towerflow.cluster.server import Server
from towerflow.cluster.spec import ClusterSpec

__all__ = ["ClusterSpec", "RemoteFuture", "Server", "TaskInfo", "function", "read_task", "remote"]
