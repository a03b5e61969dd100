"""Which address and network interface a task uses, from its own entry in the cluster spec alone.

torch.distributed's libraries each guess the address to advertise from the machine's hostname,
and on Debian/Ubuntu machines the hostname maps to 127.0.0.1 in /etc/hosts: a task would then
tell its peers on other hosts to call it on their own loopback. So towerflow decides once, here,
for every library (the rendezvous store, remote calls, gloo and NCCL):

- an entry whose host resolves to an address of one of this machine's interfaces binds there,
  and the libraries are pointed at that interface (GLOO_/TP_/NCCL_SOCKET_IFNAME, unless set);
- an entry that names this machine by a hostname mapped to loopback, in a cluster with tasks
  on other hosts, binds the address this machine uses to reach those hosts (the kernel's route,
  asked with an unsent UDP connect): the address the other hosts know it by;
- a cluster whose every entry is on loopback stays on loopback;
- an entry that no interface of this machine owns fails at once, naming the entry, the local
  addresses and the fix.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from typing import Dict, List, Mapping, Optional

from towerflow.cluster.spec import ClusterSpec, split_address
from towerflow.errors import ClusterJoinError, ClusterSpecError

# The variables through which gloo, TensorPipe and NCCL are told which interface to use.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_LITERAL_LOOPBACK = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


@dataclasses.dataclass(frozen=True)
class Binding:
    """Where one task listens and what it tells its peers."""

    entry: str  # the task's host:port in the cluster spec
    host: str  # the IP address it binds and advertises
    port: int
    interface: str  # the network interface that owns `host`
    multi_host: bool  # whether the cluster has tasks on other machines

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def socket_environment(self) -> Dict[str, str]:
        """The interface choice for gloo, TensorPipe and NCCL."""
        return {name: self.interface for name in SOCKET_IFNAME_VARIABLES}


def local_addresses() -> Dict[str, str]:
    """Every IP address of this machine's interfaces -> the interface's name."""
    import psutil

    out: Dict[str, str] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.setdefault(a.address.split("%", 1)[0], name)  # fe80::1%eth0 -> fe80::1
    return out


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def resolve(host: str, where: str = "") -> List[str]:
    """The IP addresses `host` stands for on this machine (literal addresses as they are)."""
    if _is_literal(host):
        return [str(ipaddress.ip_address(host))]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        at = f" ({where})" if where else ""
        raise ClusterSpecError(
            f"cannot resolve host {host!r}{at}: {e.strerror}. Use a name this machine resolves (DNS or /etc/hosts) "
            "or an IP address in the cluster file."
        ) from None
    seen: List[str] = []
    for info in infos:
        ip = info[4][0].split("%", 1)[0]
        if ip not in seen:
            seen.append(ip)
    return seen


def _remote_hosts(cluster: ClusterSpec, local: Mapping[str, str]) -> List[str]:
    """IP addresses of the cluster's hosts that are not this machine, in spec order."""
    out = []
    for t in cluster.tasks():
        host, _ = split_address(cluster.task_address(t.job, t.task), any_port=True)
        ips = resolve(host, f"/job:{t.job}/task:{t.task}")
        if not any(ip in local or _is_loopback(ip) for ip in ips):
            out.append(ips[0])
    return out


def route_source(remote_ip: str) -> str:
    """The local address the kernel would send from to reach `remote_ip` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in remote_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((remote_ip, 9))
        except OSError as e:  # no route: this host's network is down, or the address is not reachable from here
            raise ClusterJoinError(
                f"this machine ({socket.gethostname()}) has no route to {remote_ip}, where another task of the cluster "
                f"is ({e.strerror or e}): check that its network is up and that the cluster file's addresses are "
                "reachable from here") from None
        return s.getsockname()[0].split("%", 1)[0]


def _listing(local: Mapping[str, str]) -> str:
    return ", ".join(f"{ifname} {ip}" for ip, ifname in sorted(local.items(), key=lambda kv: (kv[1], kv[0])))


def binding_for(cluster: ClusterSpec, job: str, index: int, local: Optional[Mapping[str, str]] = None) -> Binding:
    """Where task (job, index) listens when it runs on this machine; ClusterSpecError when it cannot."""
    local = local_addresses() if local is None else local
    entry = cluster.task_address(job, index)
    name = f"/job:{job}/task:{index}"
    host, port = split_address(entry, name, any_port=True)  # port 0: the task binds any free port
    ips = resolve(host, name)
    remote = _remote_hosts(cluster, local)
    owned = [ip for ip in ips if ip in local and not _is_loopback(ip)]
    if owned:
        return Binding(entry, owned[0], port, local[owned[0]], bool(remote))
    if all(_is_loopback(ip) for ip in ips):
        if not remote:
            ip = ips[0]
            return Binding(entry, ip, port, local.get(ip, "lo"), False)
        if host.lower() in _LITERAL_LOOPBACK or _is_literal(host):
            raise ClusterSpecError(
                f"{name} is at {entry!r}, a loopback address, but the cluster has tasks on other hosts (at "
                f"{', '.join(remote[:3])}): they cannot reach it there. Give {name} this machine's hostname or "
                f"one of its addresses ({_listing(local)}) in the cluster file."
            )
        source = route_source(remote[0])  # this machine's name maps to loopback here (Debian's /etc/hosts)
        return Binding(entry, source, port, _interface_of(source, local), True)
    raise ClusterSpecError(
        f"{name} is at {entry!r}, which resolves to {', '.join(ips)}, but no interface of this machine "
        f"({socket.gethostname()}) has that address: its addresses are {_listing(local)}. Start {name} on the "
        f"machine that owns {host!r}, or correct its entry in the cluster file."
    )


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _interface_of(ip: str, local: Mapping[str, str]) -> str:
    if ip in local:
        return local[ip]
    raise ClusterSpecError(f"this machine routes to its peers from {ip}, which none of its interfaces has ({_listing(local)})")


def dial_host(cluster: ClusterSpec, host: str, local: Optional[Mapping[str, str]] = None) -> str:
    """What to connect to for a spec host from this machine.

    A hostname that maps to loopback here names this machine; in a multi-host cluster its tasks
    listen on the routed address (see `binding_for`), so that is what to dial.
    """
    ips = resolve(host)
    if not all(_is_loopback(ip) for ip in ips) or host.lower() in _LITERAL_LOOPBACK or _is_literal(host):
        return ips[0]
    local = local_addresses() if local is None else local
    remote = _remote_hosts(cluster, local)
    return route_source(remote[0]) if remote else ips[0]

