"""The processes a launcher command started, wherever they went: what `command.py` ends.

A launcher owns its processes, and some leave its process group: torchrun's agent (and
`accelerate launch --multi_gpu`, which runs it) starts each worker in a session of its own
(`start_new_session=True`), so a signal to the launcher's group, or a Ctrl-C at the terminal,
never reaches them. They stay the tool's descendants, though: the tool makes itself the
subreaper of its descendants (`PR_SET_CHILD_SUBREAPER`), so a worker whose launcher died
is re-parented to the tool, not to init, and a walk of /proc from the tool finds them all.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans among this process's descendants become its children (Linux; else a no-op)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def children(pid: int) -> set[int]:
    """The live children of `pid`."""
    return {p for p, pp in _parents().items() if pp == pid}


def descendants(root: int, spared: set[int] = frozenset()) -> list[int]:
    """Every live process below `root` (children first), but `spared` and those below them."""
    parent_of = _parents()
    below, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        kids = [p for p, pp in parent_of.items() if pp == pid and p not in below]
        kids = [p for p in kids if p not in spared]
        below += kids
        todo += kids
    return below


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (not zombies), from /proc."""
    parent_of: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != b"Z":
                parent_of[int(name)] = int(fields[1])
    return parent_of


def end_all(pids: list[int], launcher, grace_s: float, spared: set[int] = frozenset()) -> None:
    """End the launcher `launcher` (a Popen), the processes `pids` and everything below this
    process but the `spared` (what it ran before the launcher): with a `grace_s`, SIGTERM to the launcher first (it tears its workers down its
    own way) and that long to do it; then SIGKILL to the launcher (without a grace: before it
    sees its workers die and prints its own report of it) and to every one left, and reap
    those that are this process's children."""
    if grace_s > 0 and launcher.poll() is None:
        with contextlib.suppress(OSError):
            launcher.send_signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            launcher.wait(grace_s)
    with contextlib.suppress(OSError):
        launcher.kill()
    me = os.getpid()
    for _ in range(3):  # a process forked while we were killing is caught next round
        left = set(pids) | set(descendants(me, spared))
        left.discard(me)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            launcher.wait(2.0)
        reap(spared)
        time.sleep(0.05)
    reap(spared)


def reap(spared: set[int] = frozenset()) -> None:
    """Collect the exit status of this process's dead children (orphans it adopted), but of
    the `spared`, whose owners collect theirs."""
    for pid in set(descendants_of_me_dead()) - set(spared):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def descendants_of_me_dead() -> list[int]:
    """This process's children that are zombies."""
    me, dead = str(os.getpid()).encode(), []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] == b"Z" and fields[1] == me:
                dead.append(int(name))
    return dead
