"""CPU evidence of a rank: what tells a rank that computes from one that is stuck.

A rank that waits in a collective, sleeps, or blocks on a lock that nobody releases uses no
CPU (a gloo rank waiting 5 s in an all_reduce used 0.01 s) and none of its threads is
runnable. A rank that computes (an evaluation pass, a slow data step) either runs or waits
for a core: when other processes crowd the cores its CPU share can fall to a few percent (one
of thirty runnable processes on two cores; a rank run under `nice`), but its computing
thread stays runnable (state R) all the time. So the watchdog asks, before it calls a rank
hung: did its CPU time advance, or was one of its threads runnable at most samples?

The evidence covers the rank's process (every thread) and its live descendants (DataLoader
workers compute for it), read from /proc. Off Linux there is no /proc: `sample_tree` returns
None and the watchdog falls back to silence alone.

A process that measures itself (a torchrun job's node watchdog is a thread of its LOCAL_RANK 0
rank) leaves out the thread doing the measuring: it is running whenever it reads its own
state, and it spends the CPU of the reading, so with it every sample would say "working".
"""

from __future__ import annotations

import os
import threading
from collections import deque

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MAX_DESCENDANTS = 256


def sample_tree(pid: int) -> tuple[float, bool] | None:
    """(user + system CPU seconds, whether a thread is runnable now) of `pid` and its live
    descendants; None if it is gone or /proc is not there."""
    own = _sample_process(pid, threading.get_native_id() if pid == os.getpid() else None)
    if own is None:
        return None
    total, runnable, children = own
    seen, todo = {pid}, children
    while todo and len(seen) < _MAX_DESCENDANTS:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        if (theirs := _sample_process(child)) is not None:
            total += theirs[0]
            runnable = runnable or theirs[1]
            todo.extend(theirs[2])
    return total, runnable


def _sample_process(pid: int, skip: int | None = None) -> tuple[float, bool, list[int]] | None:
    """CPU seconds of `pid` (all its threads but `skip`), whether one of those threads is
    runnable, and its children."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        return None
    if fields[0] == b"Z":  # a zombie computes nothing
        return 0.0, False, []
    cpu = _cpu(fields)
    runnable = False
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        thread = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if thread is not None and skip is not None and int(tid) == skip:
            cpu -= _cpu(thread)  # the measuring thread: neither its state nor its CPU
        elif thread is not None and thread[0] == b"R":
            runnable = True
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return cpu, runnable, children


def _cpu(fields: list[bytes]) -> float:
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a /proc stat file after the command name (which may itself hold spaces
    and parentheses): [state, ppid, ...]."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].split()


class CpuMeter:
    """Samples one process tree's CPU evidence and says whether it is working now.

    `busy()` is True when, over the last `window_s`, the tree used at least `fraction` of one
    core, or had a runnable thread at more than `runnable` of the samples. Either alone fails
    somewhere: CPU share falls below any fixed fraction on a crowded machine (a rank at
    `nice 19` beside two busy processes per core gets about 1%), and a runnable snapshot can
    miss a rank that computes in short bursts between sleeps.

    The two mistakes cost differently, and the meter leans to "busy". A computing rank read
    as idle once, while a peer waits, is a false hang at once; a waiting rank read as busy
    only delays the verdict to a later poll. On a crowded machine a waiting rank's own
    wake-ups (the tool's helper thread, 5 times a second) wait for a core and can be caught
    runnable at some samples of a window; a computing rank is runnable at all of them, its
    main thread or (while that waits for the GIL) the thread holding it.
    """

    def __init__(
        self, pid: int, *, window_s: float = 1.0, fraction: float = 0.05, runnable: float = 0.5
    ) -> None:
        self.pid = pid
        self.window_s = window_s
        self.fraction = fraction
        self.runnable = runnable
        self.samples: deque[tuple[float, float, bool]] = deque()

    def sample(self, now: float) -> None:
        sampled = sample_tree(self.pid)
        if sampled is None:
            return
        self.samples.append((now, *sampled))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def busy(self) -> bool:
        """Did the tree use `fraction` of a core, or have a runnable thread at more than
        `runnable` of the samples, over (about) the last `window_s`?"""
        if len(self.samples) < 2:
            return False
        (t0, c0, _), (t1, c1, _) = self.samples[0], self.samples[-1]
        if t1 - t0 < self.window_s / 2:  # too short to tell
            return False
        if (c1 - c0) >= self.fraction * (t1 - t0):
            return True
        runnable = sum(r for _, _, r in self.samples) / len(self.samples)
        # Strictly more than the share: with two samples (the sampler itself late on a
        # crowded machine) one runnable snapshot is a wake-up as often as it is work.
        return runnable > self.runnable

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    def quiet_since(self) -> float | None:
        """When the window that shows no work began (in the clock `sample` was given), if the
        tree is not busy over a window long enough to tell; else None. Every later sample's
        window overlaps this one, so "quiet since" holds for as long as `busy()` stays False."""
        if len(self.samples) < 2 or self.samples[-1][0] - self.samples[0][0] < self.window_s / 2:
            return None
        return None if self.busy() else self.samples[0][0]
