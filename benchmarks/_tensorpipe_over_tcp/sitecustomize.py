"""Put first on PYTHONPATH, makes torch.distributed.rpc carry tensors over its TCP connection.

TensorPipe hands a tensor between two processes of one kernel to its CMA channel
(process_vm_readv: one memory copy, no network), and network namespaces on one machine share
the kernel: across `tests/multihost/netns.py` hosts the old RPC path moved its tensors as if on
one host. Real hosts have no CMA, so `ps_hosts_before_tcp` (benchmarks/ps_step.py) runs the tree
from before ZeroMQ with TensorPipe's "basic" channel alone: tensors go over the transport's TCP
connection, as they would between two machines.
"""

from torch.distributed import rpc

_init = rpc.TensorPipeRpcBackendOptions.__init__


def _network_only(self, *args, **kwargs):
    kwargs.setdefault("_channels", ["basic"])
    _init(self, *args, **kwargs)


rpc.TensorPipeRpcBackendOptions.__init__ = _network_only
