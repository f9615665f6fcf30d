"""The processes a launcher command started, wherever they went: what `command.py` ends.

A launcher owns its processes, and some leave its process group: torchrun's agent (and
`accelerate launch --multi_gpu`, which runs it) starts each worker in a session of its own
(`start_new_session=True`), so a signal to the launcher's group, or a Ctrl-C at the terminal,
never reaches them. They stay the tool's descendants, though: while a launch lasts the tool
is the subreaper of its descendants (`PR_SET_CHILD_SUBREAPER`, `subreaper()`), so a worker
whose launcher died is re-parented to the tool, not to init, and a walk of the process table
(psutil) from the tool finds them all; the run's folder in their environment tells them from
the processes of another run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

import psutil

_PR_SET_CHILD_SUBREAPER = 36
GONE_S = 10.0  # how long a SIGKILLed process may take to be gone


_subreaping = 0  # launches in progress in this process that asked for it
_lock = threading.Lock()


@contextlib.contextmanager
def subreaper():
    """While it lasts, orphans among this process's descendants become its children (Linux;
    else nothing). Counted: launches side by side in one process (threads) share it, and the
    last one out turns it off again, so a process that ran one launch does not go on adopting
    the orphans of everything else it starts, which it would never reap: zombies that keep
    their session alive (a TensorBoard stopped by its session was "left behind")."""
    global _subreaping
    with _lock:
        if _subreaping == 0:
            _set_subreaper(1)
        _subreaping += 1
    try:
        yield
    finally:
        with _lock:
            _subreaping -= 1
            if _subreaping == 0:
                _set_subreaper(0)


def _set_subreaper(on: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, on, 0, 0, 0)


def descendants(root: int) -> list[int]:
    """Every live process below `root` (none once it is gone)."""
    try:
        below = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    return [p.pid for p in below if live(p.pid)]


def group_members(pgid: int) -> list[int]:
    """Every live process (not zombies) of process group `pgid`."""
    return [pid for pid in psutil.pids() if _group(pid) == pgid and live(pid)]


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def carries(pid: int, marker: bytes) -> bool:
    """Whether process `pid` started with `marker` (`NAME=value`) in its environment: every
    process of one launch inherits the run's folder, so runs side by side in one process (a
    test's threads) never end each other's processes."""
    name, _, value = os.fsdecode(marker).partition("=")
    try:
        return psutil.Process(pid).environ().get(name) == value
    except psutil.Error:
        return False


def end_all(pids: list[int], launcher, grace_s: float, marker: bytes) -> None:
    """End the launcher `launcher` (a Popen), the processes `pids` (its ranks) and every
    process of the launch: those below the launcher, and those below this process that carry
    `marker` (a launcher's workers re-parented here once it died). With a `grace_s`, SIGTERM
    to the launcher first (it tears its workers down its own way) and that long to do it;
    then SIGKILL to the launcher (without a grace: before it sees its workers die and prints
    its own report of it) and to every one left, and reap those that were this process's
    children."""
    if grace_s > 0 and launcher.poll() is None:
        with contextlib.suppress(OSError):
            launcher.send_signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            launcher.wait(grace_s)
    below = descendants(launcher.pid) if launcher.poll() is None else []
    with contextlib.suppress(OSError):
        launcher.kill()
    me, killed = os.getpid(), set()
    for _ in range(3):  # a process forked while we were killing is caught next round
        left = set(pids) | set(below) | {p for p in descendants(me) if carries(p, marker)}
        left -= {me, launcher.pid} | killed
        left = {p for p in left if live(p)}
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= left
        below = []
        with contextlib.suppress(Exception):
            launcher.wait(2.0)
        # A SIGKILLed process is gone only once it has been scheduled to exit (seconds on a
        # loaded machine): none may be left when the tool returns.
        end = time.monotonic() + GONE_S
        while any(live(p) for p in left) and time.monotonic() < end:
            _reap(killed)
            time.sleep(0.02)
        _reap(killed)
    _reap(killed)


def live(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_time(pid: int) -> float | None:
    """When `pid` started, in seconds after boot: with the pid, what names one process, never
    another that got the same pid later; None when it is gone. (psutil's create_time is wall
    clock, moved by an NTP step between two readings; less the boot time, moved with it, it is
    the kernel's record, to its 10 ms ticks: rounded, every reading gives the same number.)"""
    try:
        return round(psutil.Process(pid).create_time() - psutil.boot_time(), 3)
    except psutil.Error:
        return None


def _reap(pids: set[int]) -> None:
    """Collect the exit status of those of `pids` that were this process's children (orphans
    it adopted as their subreaper); the others are somebody else's to reap."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
