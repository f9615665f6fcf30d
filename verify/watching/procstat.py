"""CPU time of a rank: the evidence that tells a rank that computes from one that is stuck.

A rank that waits in a collective, sleeps, or blocks on a lock that nobody releases uses no
CPU (a gloo rank waiting 5 s in an all_reduce used 0.01 s). A rank that computes (an
evaluation pass, a slow data step) uses CPU all the time, even when other processes crowd the
cores. So the watchdog asks, before it calls a rank hung: did its CPU time advance?

The CPU time of a rank is that of its process (every thread) and of its live descendants
(DataLoader workers compute for it), read from /proc in clock ticks. Off Linux there is no
/proc: `cpu_seconds` returns None and the watchdog falls back to silence alone.
"""

from __future__ import annotations

import os
from collections import deque

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MAX_DESCENDANTS = 256


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` and its live descendants; None if it is gone or
    /proc is not there."""
    total = _own_cpu(pid)
    if total is None:
        return None
    seen, todo = {pid}, list(_children(pid))
    while todo and len(seen) < _MAX_DESCENDANTS:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        total += _own_cpu(child) or 0.0
        todo.extend(_children(child))
    return total


def _own_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # Fields after the command name, which may itself hold spaces and parentheses.
    fields = raw[raw.rfind(b")") + 2 :].split()
    if fields[0] == b"Z":  # a zombie computes nothing
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


class CpuMeter:
    """Samples one process tree's CPU time and says whether it is working now.

    `busy()` is True when, over the last `window_s`, the tree used at least `fraction` of one
    core. The fraction is low on purpose: a rank that computes while other processes crowd the
    cores still gets a share of them (1/6 of a core with 6 runnable processes on 2 cores),
    while a waiting rank's background threads stay far below it.
    """

    def __init__(self, pid: int, *, window_s: float = 1.0, fraction: float = 0.05) -> None:
        self.pid = pid
        self.window_s = window_s
        self.fraction = fraction
        self.samples: deque[tuple[float, float]] = deque()

    def sample(self, now: float) -> None:
        cpu = cpu_seconds(self.pid)
        if cpu is None:
            return
        self.samples.append((now, cpu))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def busy(self) -> bool:
        """Did the tree use `fraction` of a core over (about) the last `window_s`?"""
        if len(self.samples) < 2:
            return False
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        if t1 - t0 < self.window_s / 2:  # too short to tell
            return False
        return (c1 - c0) >= self.fraction * (t1 - t0)

    @property
    def measured(self) -> bool:
        return bool(self.samples)
