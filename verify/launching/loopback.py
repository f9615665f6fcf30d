"""Where a gloo group the tool creates listens: loopback when every rank is on this machine.

Gloo listens on the address its device gives it: the interface `GLOO_SOCKET_IFNAME` names,
else whatever the host name resolves to, which on most machines is its network address. A
group the tool makes for itself (the audit's side group, the group a torchrun job's ranks
agree their secret over) is pinned to the loopback interface where the evidence says every
rank runs here: torchrun's LOCAL_WORLD_SIZE equal to WORLD_SIZE (one node), or the job's store
on a loopback address. Elsewhere (a job across nodes, or no evidence) the group must reach
the other machines, and gets torch's own default device, the one the job's own groups use:
it then faces no network the job does not already face. A `GLOO_SOCKET_IFNAME` the user set
wins, as it does for the job's groups.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist


def ifname() -> str:
    """The loopback interface's name (`lo` on Linux)."""
    return next((n for _, n in socket.if_nameindex() if n.startswith("lo")), "lo")


def one_machine(store=None) -> bool:
    """Every rank of the job runs on this machine, as far as the evidence says (docstring):
    torchrun's variables, else the job's store (`store`, unwrapped of its prefixes) on a
    loopback address. No evidence: False."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is not None and world is not None:
        return local == world
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return _loopback(store.host)
    return False


def interface(store=None) -> str | None:
    """The interface a tool's gloo group is created on; None: torch's default device."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not one_machine(store):
        return None
    return ifname()


def gloo_group(store, rank: int, size: int, timeout: datetime.timedelta):
    """A `ProcessGroupGloo` over `store` (its rendezvous), on `interface(store)`: returns the
    group and the interface (None: torch's default device)."""
    name = interface(store)
    if name is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout), None
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(interface=name)]
    return dist.ProcessGroupGloo(store, rank, size, options), name


def _loopback(host: str) -> bool:
    try:
        return all(
            ipaddress.ip_address(info[4][0]).is_loopback
            for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        )
    except (OSError, ValueError):
        return False
