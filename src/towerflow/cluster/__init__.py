"""Clusters: ClusterSpec, Server, remote execution on /job:x/task:y, and the task environment.

Names are imported on first use (towerflow/_lazy.py): the launcher reads cluster specs without torch.
"""

from typing import TYPE_CHECKING

from towerflow import _lazy

# `remote` (the decorator) is not among them: the name is this package's submodule cluster/remote.py;
# the decorator is `towerflow.remote`.
__all__ = ["ClusterSpec", "RemoteFuture", "Server", "TaskInfo", "function", "read_task"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    **_lazy.names_from("towerflow.cluster.environment", ["TaskInfo", "read_task"]),
    **_lazy.names_from("towerflow.cluster.remote", ["RemoteFuture", "function"]),
    "Server": "towerflow.cluster.server",
    "ClusterSpec": "towerflow.cluster.spec",
})

if TYPE_CHECKING:
    from towerflow.cluster.environment import TaskInfo, read_task  # noqa: F401
    from towerflow.cluster.remote import RemoteFuture, function  # noqa: F401
    from towerflow.cluster.server import Server  # noqa: F401
    from towerflow.cluster.spec import ClusterSpec  # noqa: F401
