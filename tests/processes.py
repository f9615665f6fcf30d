"""What the tests ask about processes: is one still alive, what runs below one, what it
listens on, a port for one to listen on; the launches a test session runs once for all its
workers; the machine's lock (a test alone on it, or sharing it) and the CPU hogs that keep
every core busy."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import pickle
import random
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verify.launching.process import alive

# "1": skip the `under_load` tests as a run with the hog window does, though this one has
# none (`python -m tests.cpu_seconds` runs each file alone and counts what the suite runs)
AS_IN_THE_SUITE = "DDP_VERIFY_TESTS_AS_IN_THE_SUITE"

__all__ = [
    "Listener", "alive", "descendants", "free_port", "hogs", "listeners", "machine_lock",
    "once_per_session", "session_members",
]  # fmt: skip


def _session_root(tmp_path_factory) -> Path:
    """The temp dir every xdist worker of this session shares."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@contextlib.contextmanager
def machine_lock(tmp_path_factory, alone: bool):
    """The session's machine lock (tests/conftest.py): shared while other tests may run beside,
    exclusive while this one must be alone on the machine (`alone`). Every test holds it
    through conftest's autouse fixture; a module-scoped fixture that must run alone takes it
    itself (it is set up before that fixture: the lock is not held there yet)."""
    with open(_session_root(tmp_path_factory) / "machine.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


@contextlib.contextmanager
def hogs():
    """One busy process per core, killed on the way out whatever happens: yields their pids.

    Each in a session of its own, as every rank the tool starts is (and another user's job):
    where the kernel shares the CPU among sessions first (autogroup, on here), hogs in the
    test's own session shared one session's slice among them, beside twenty ranks' sessions,
    and got 5% of the hog window's CPU (25.7 of 498.8 CPU-s; 21%, 133.7 of 624.0, in sessions
    of their own); a task in a session of its own, 2 CPU-s of work, took 2.13 s beside two
    of them in the caller's session, 3.26 s beside two in sessions of their own (2.03 idle)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def once_per_session(
    tmp_path_factory,
    name: str,
    compute: Callable[[Path], Any],
    dumps: Callable[[Any], bytes] = pickle.dumps,
    loads: Callable[[bytes], Any] = pickle.loads,
) -> Any:
    """`compute(folder)` run once per test session, whatever the number of xdist workers: the
    first worker to get here runs it under a file lock and leaves its result (`dumps`) in the
    session's shared temp dir; the others read it (`loads`). `folder` is for its reports."""
    root = _session_root(tmp_path_factory)
    cached = root / f"{name}.cached"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached.exists():
            cached.write_bytes(dumps(compute(root / f"{name}-reports")))
    return loads(cached.read_bytes())


# free_port's ports: blocks of PORT_BLOCK from FIRST_PORT up to the kernel's ephemeral range.
# Each process walks its block from a place of its own: two test sessions on one machine (or
# more workers than blocks) would otherwise hand out the same ports in step.
FIRST_PORT, PORT_BLOCK = 20000, 100
_picks = itertools.count(random.randrange(PORT_BLOCK))  # next() is atomic: the window's threads


def free_port() -> int:
    """A loopback port nothing listens on, for a script or a launcher to bind later.

    Not one the kernel hands out (bind to port 0): once closed here, the kernel may hand it
    to any socket bound to port 0 before the script binds it (gloo's pairs, a rendezvous
    store, `torchrun --standalone`), and the script fails with EADDRINUSE (an mp.spawn
    fixture in the hog window, once). So the port lies below the ephemeral range, where
    nothing binds unless asked: there only ports picked here (or named by a fixture: 23456,
    29500, in blocks past the 34th) can meet, and each xdist worker walks a block of its
    own, one port after the other, skipping any that is taken."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    blocks = (low - FIRST_PORT) // PORT_BLOCK
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    for _ in range(PORT_BLOCK if blocks > 0 else 0):
        port = FIRST_PORT + (worker % blocks) * PORT_BLOCK + next(_picks) % PORT_BLOCK
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (ranks may be the tool's children or its zygote's)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(stat[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent and p not in out]
        out.update(kids)
        todo.extend(kids)
    return out


def report_pids(folder: Path) -> list[int]:
    """The ranks' process ids of every run whose report (report.json, with its `pids`) lies
    below `folder`; a usage error writes no report."""
    pids = []
    for path in folder.glob("**/report.json"):
        pids += [int(p) for p in json.loads(path.read_text()).get("pids", {}).values()]
    return pids


def still_running(folder: Path) -> list[int]:
    """Those of `report_pids(folder)` still alive."""
    return [p for p in report_pids(folder) if alive(p)]


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (a launcher started as a session leader, and whatever
    it started: its ranks die with it, or are left behind, which a test asserts against)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            members.append(int(stat.parent.name))
    return members


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket, as the system's socket table has it."""

    pid: int
    address: str  # "127.0.0.1", "::1", "0.0.0.0", "::", ...
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback or self.address == "::ffff:7f00:1"


def listeners(pids: set[int]) -> set[Listener]:
    """Every TCP socket in the LISTEN state held by one of `pids`, read from /proc/net/tcp and
    tcp6 (the kernel's table, whatever created the socket: Python, torch, gloo, a server a
    process started) and matched to its holders through the socket inodes in /proc/PID/fd."""
    table: dict[str, tuple[str, int]] = {}  # inode -> (address, port)
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with contextlib.suppress(OSError):
            for line in Path("/proc/net", name).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                addr, port = fields[1].split(":")
                raw = bytes.fromhex(addr)  # 32-bit words, each in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                table[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    found = set()
    for pid in pids:
        fd_dir = Path("/proc", str(pid), "fd")
        with contextlib.suppress(OSError):  # gone, or not ours to read
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in table:
                        found.add(Listener(pid, *table[target[8:-1]]))
    return found
