"""CPU evidence of a rank: what tells a rank that computes from one that is stuck.

A rank that waits in a collective, sleeps, or blocks on a lock that nobody releases uses no
CPU (a gloo rank waiting 5 s in an all_reduce used 0.01 s) and none of its threads is
runnable. A rank that computes (an evaluation pass, a slow data step) either runs or waits
for a core: when other processes crowd the cores its CPU share can fall to a few percent (one
of thirty runnable processes on two cores; a rank run under `nice`), but its computing
thread stays runnable (state R) all the time. So the watchdog asks, before it calls a rank
hung: did its CPU time advance, or was one of its threads runnable at most samples?

The evidence covers the rank's process (every thread) and its live descendants (DataLoader
workers compute for it), read with psutil. A thread's own state is Linux's alone (psutil has
none, but Linux names a thread like a process): elsewhere the evidence is CPU time only, and
for a process that measures itself (below) there is none, so the watchdog falls back to
silence alone.

A process that measures itself (a torchrun job's node watchdog is a thread of its LOCAL_RANK 0
rank) leaves out the thread doing the measuring: it is running whenever it reads its own
state, and it spends the CPU of the reading, so with it every sample would say "working".
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict, deque

import psutil

_MAX_DESCENDANTS = 256
# One walk of the process table serves every meter that long (psutil reads every process for
# the children of any one: ~10 ms for 130): a new descendant counts from the next walk.
_TREE_S = 1.0
_walked: tuple[float, dict[int, list[int]]] = (-_TREE_S, {})  # (when, parent -> children)


def sample_tree(pid: int) -> tuple[float, bool] | None:
    """(user + system CPU seconds, whether a thread is runnable now) of `pid` and its live
    descendants; None if it is gone, or measures itself off Linux (its measuring thread
    cannot be told from the others there)."""
    skip = threading.get_native_id() if pid == os.getpid() else None
    if skip is not None and not psutil.LINUX:
        return None
    own = _sample_process(pid, skip)
    if own is None:
        return None
    total, runnable = own
    children = _children()
    below, todo = 0, list(children.get(pid, ()))
    while todo and below < _MAX_DESCENDANTS:
        child = todo.pop()
        below += 1
        if (theirs := _sample_process(child)) is not None:
            total += theirs[0]
            runnable = runnable or theirs[1]
            todo.extend(children.get(child, ()))
    return total, runnable


def _children() -> dict[int, list[int]]:
    """parent pid -> its children's pids, of every process, as walked at most `_TREE_S` ago."""
    global _walked
    now = time.monotonic()
    if now - _walked[0] > _TREE_S:
        children = defaultdict(list)
        for p in psutil.process_iter(["ppid"]):
            children[p.info["ppid"]].append(p.pid)
        _walked = (now, children)
    return _walked[1]


def _sample_process(pid: int, skip: int | None = None) -> tuple[float, bool] | None:
    """CPU seconds of `pid` (all its threads but `skip`) and whether one of those threads is
    runnable (Linux; elsewhere never said)."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            if process.status() == psutil.STATUS_ZOMBIE:  # a zombie computes nothing
                return 0.0, False
            cpu = process.cpu_times()
            threads = process.threads() if psutil.LINUX else []
    except psutil.Error:
        return None
    total, runnable = cpu.user + cpu.system, False
    for thread in threads:
        if thread.id == skip:  # the measuring thread: neither its state nor its CPU
            total -= thread.user_time + thread.system_time
        elif not runnable:
            runnable = _status(thread.id) == psutil.STATUS_RUNNING
    return total, runnable


def _status(tid: int) -> str | None:
    """A thread's own state (Linux: a thread id names the thread as a pid does a process)."""
    try:
        return psutil.Process(tid).status()
    except psutil.Error:
        return None


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
