"""The job's key-value store under torchrun, as a rank of the tool reaches it: a client, never
its server.

torchrun's agent hosts the job's store at MASTER_ADDR:MASTER_PORT before it starts a rank
(`TORCHELASTIC_USE_AGENT_STORE=True` tells the ranks so), so a rank never needs to host it.
A process whose RANK, WORLD_SIZE and MASTER_ADDR are left over from a job (a shell that once
ran one) has no agent behind it: were it rank 0 of `env://`, it would become the server of a
store on every interface (PyTorch's `TCPStore` binds all of them), wait two minutes for peers
that never come, and unpickle whatever reached it. So the tool tells a real rank from a stale
environment by the one thing a real rank has, the store answering: it connects as a client,
and where nothing answers within `REACH_S` that is one line (`ValueError`: exit 2), with
nothing listened on. Each try is a short Python call, so a signal (Ctrl-C, SIGTERM) is acted
on at once.

The one launcher that asks rank 0 to host is torchrun's etcd rendezvous, which says so
(`TORCHELASTIC_USE_AGENT_STORE=False`): there rank 0 hosts, as torch would, the user's
launcher's choice.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

REACH_S = 5.0  # an agent's store is up before its ranks start: this is only a grace
_TRY_S = 1.0  # one connection attempt


def connect(timeout: datetime.timedelta) -> dist.Store:
    """A client of the job's store at MASTER_ADDR:MASTER_PORT, its operations' timeout
    `timeout`. Raises ValueError (one line) where MASTER_PORT is no port or nothing answers."""
    host, port = os.environ["MASTER_ADDR"], os.environ.get("MASTER_PORT", "")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"MASTER_PORT={port!r} is not a port (1-65535): it names the job's store")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":  # rank 0 hosts (docstring)
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        return store
    _reach(host, int(port))
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)


def _reach(host: str, port: int) -> None:
    """Return once something listens at host:port, within REACH_S; else ValueError. Probed
    with a plain socket, not a store client: the client's failed tries are logged by c10d,
    a screen of C++ frames where the user is owed one line."""
    end = time.monotonic() + REACH_S
    while True:
        try:
            with socket.create_connection((host, port), timeout=_TRY_S):
                return
        except OSError:  # refused, unreachable, or a name that does not resolve
            if time.monotonic() >= end:
                raise ValueError(stale(host, str(port))) from None
        time.sleep(0.2)


def stale(host: str, port: str) -> str:
    """Why a rank that reached no store cannot run, in one line."""
    return (
        f"RANK={os.environ.get('RANK')} WORLD_SIZE={os.environ.get('WORLD_SIZE')} "
        f"MASTER_ADDR={host} MASTER_PORT={port} are set, as in a torchrun rank, but no job's "
        f"store answers there within {REACH_S:g}s: run under torchrun, or unset them to let the "
        "tool start its own ranks"
    )
