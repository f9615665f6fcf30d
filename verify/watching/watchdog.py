"""The hang verdict, reached on evidence rather than on silence.

Every rank writes its collectives into a trace file (`tracer.py`); the watchdog reads the
headers. The run is hung when, for `stall_timeout_s`:

1. no rank issued or completed a collective, and
2. at least one rank waits inside a collective: a traced one, or, where the trace is blind,
   a call into torch's C++ that blocks waiting for peers (PyTorch DDP's reducer in backward,
   its constructor's broadcasts: the rank's main thread is inside torch's distributed or
   autograd code, `stacks.main_thread_in_torch`, and every rank has been still, its CPU time
   not advancing, for the stall timeout: `blind.py`), and
3. no other rank is working: none used CPU or kept a thread runnable over the last second
   (`procstat.CpuMeter`: a rank starved of cores still waits to run), and
   none is still starting (it has not joined the process group yet, within `startup_s` of
   the start: a rank importing torch on a crowded machine, or meeting its peers, is not
   hung).

A rank excused by (3) is the reason the others wait, not a fault: a rank that computes for
12 s (an evaluation pass) while its peer waits in the next all_reduce is reported as a note,
"rank 1 computed for 12.3 s outside any collective at eval.py:19 while the others waited",
never as a hang. A rank parked outside any collective with no CPU progress (a deadlock, a
lost message, a sleep longer than the stall timeout), a skipped collective, a mismatch and
a dead peer still meet all three conditions and are called at the stall timeout, within the
CPU window (one second) of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from verify.watching import trace_file
from verify.watching.blind import Stillness
from verify.watching.procstat import CpuMeter

SAMPLE_S = 0.25  # CPU sampling period: 4 samples of each rank's process tree a second


@dataclass
class _Excuse:
    """A rank that kept the run from being called hung while the others waited."""

    rank: int
    why: str  # "computing" | "starting"
    since_wall: float  # when the others started waiting (the last progress)
    until_wall: float
    where: str | None = None
    asked: bool = False


# How long a rank that has issued no collective yet is still starting: to start an interpreter,
# import torch and meet (2 ranks take ~1.5 s on 2 idle cores). The one bound of the supervisor,
# the watchdog and a node's ranks in the launcher form.
STARTUP_S = 60.0


class Watchdog:
    """Reads the ranks' trace headers and CPU time; `poll()` says when the run is hung.

    Args:
        trace_paths: one trace file per rank (None: that rank is not traced).
        stall_timeout_s: seconds without progress that make a hang (given the evidence).
        where: `where(rank, ask)` returns where the rank's main thread is (`path:line`),
            asking the rank for it first when `ask` is True; None if unknown yet.
        in_torch: `in_torch(rank, ask)` says, the same way, whether the rank's main thread
            is blocked inside a torch call the trace cannot see (None: no answer yet); None
            turns that part of condition 2 off.
        startup_s: how long after the start a rank that has issued no collective is still
            starting rather than stuck.
        own_ranks: `own_ranks(rank)` says whether the rank started ranks of its own
            (`spawned.py`): one that never joined a process group itself, still with every
            process below it for the stall timeout, ends the run (`unwatched`).
    """

    def __init__(
        self,
        trace_paths: list[str | None],
        stall_timeout_s: float,
        *,
        where: Callable[[int, bool], str | None] | None = None,
        in_torch: Callable[[int, bool], bool | None] | None = None,
        startup_s: float = STARTUP_S,
        own_ranks: Callable[[int], bool] | None = None,
    ) -> None:
        self.paths = trace_paths
        self.stall_timeout_s = stall_timeout_s
        self.where = where
        self.in_torch = in_torch
        self.own_ranks = own_ranks
        self.unwatched: int | None = None  # the rank whose own ranks ended the run
        self.blind = False  # the verdict rests on ranks blocked where the trace cannot see
        # Where the trace is blind its silence says nothing: the stall is timed from the
        # ranks' CPU evidence, and the ranks are asked whether they are inside torch.
        self.still = Stillness(in_torch, stall_timeout_s / 2)
        self.startup_s = startup_s
        self.events: list[int | None] = [None] * len(trace_paths)
        self.meters: dict[int, CpuMeter] = {}
        self.started: float | None = None  # monotonic
        self.last_change: float | None = None  # monotonic
        self.last_event_wall = 0.0  # wall clock of the last progress any rank made
        self.stalled_at: float | None = None  # wall clock of the verdict
        self._last_sample = 0.0
        self._excused: dict[int, _Excuse] = {}
        self._notes: list[str] = []

    def poll(
        self, pids: list[int | None], now: float | None = None, up: set[int] | None = None
    ) -> bool:
        """Read every header (and, every SAMPLE_S, every rank's CPU time); True once hung.

        `pids[r]` is rank r's process id while it runs, None once it has exited; `up` the
        ranks that have joined the process group (None: a rank is up once it has issued a
        collective)."""
        now = time.monotonic() if now is None else now
        if self.started is None:  # the clock starts at the first poll
            self.started = self.last_change = now
            self.last_event_wall = time.time()
        headers = [trace_file.read_header(p) if p else None for p in self.paths]
        progressed = False
        for r, header in enumerate(headers):
            if header is not None and header.events != self.events[r]:
                self.events[r] = header.events
                self.last_event_wall = max(self.last_event_wall, header.last_event)
                progressed = True
        if progressed:
            self.last_change = now
            self._close_excuses()
            self.still.moved()
        if now - self._last_sample >= SAMPLE_S:
            self._last_sample = now
            for r, pid in enumerate(pids):
                if pid is None:
                    self.meters.pop(r, None)
                    self.still.drop(r)
                    continue
                meter = self.meters.get(r)
                if meter is None or meter.pid != pid:
                    meter = self.meters[r] = CpuMeter(pid)
                meter.sample(now)
                self.still.sample(r, meter, now)
        waiting = [r for r, h in enumerate(headers) if h is not None and h.pending > 0]
        if self._own_ranks_still(pids, now, up):
            return True
        if now - self.last_change < self.stall_timeout_s:
            return False
        if not waiting:
            return self._blocked_in_torch(pids, headers, now, up)
        excused = {
            r: why
            for r, pid in enumerate(pids)
            if pid is not None
            and r not in waiting
            and (why := self._working(r, headers[r], now, up)) is not None
        }
        if excused:
            for r, why in excused.items():
                self._excuse(r, why)
            return False
        self.stalled_at = time.time()
        return True

    def _blocked_in_torch(self, pids, headers, now: float, up) -> bool:
        """Condition 2 where the trace is blind: no rank waits in a traced collective, none
        works, and at least one is blocked inside torch's C++ (the others wait for it, or it
        for them). A rank that computes or starts is not excused with a note here: nobody
        was seen waiting for it."""
        if self.in_torch is None:
            return False
        live = [r for r, pid in enumerate(pids) if pid is not None]
        if not live or any(self._working(r, headers[r], now, up) for r in live):
            return False
        # Untraced collectives (a whole DDP step) leave the trace silent while ranks work: the
        # stall counts from when the last rank went still.
        still = [self.still.still_s(r, now) for r in live]
        if None in still or min(still) < self.stall_timeout_s:
            return False
        if not any(self.still.blocked(r) for r in live):  # nobody inside torch (or no answer yet)
            return False
        self.blind = True
        went_still = max(self.still.since_wall(r) for r in live)
        self.last_event_wall = max(self.last_event_wall, went_still)
        self.stalled_at = time.time()
        return True

    def _own_ranks_still(self, pids, now: float, up: set[int] | None) -> bool:
        """A rank that started ranks of its own, never joined a process group itself, and has
        been still, with every process below it, for the stall timeout: it is not starting,
        it waits for processes the tool does not watch."""
        for r, pid in enumerate(pids):
            if pid is None or self.own_ranks is None or (up is not None and r in up):
                continue
            still = self.still.still_s(r, now)
            if still is not None and still >= self.stall_timeout_s and self.own_ranks(r):
                self.unwatched = r
                self.last_event_wall = max(self.last_event_wall, self.still.since_wall(r))
                self.stalled_at = time.time()
                return True
        return False

    def _working(self, rank: int, header, now: float, up: set[int] | None) -> str | None:
        """Why `rank` (not in a collective) is not stuck: "computing", "starting" or None."""
        meter = self.meters.get(rank)
        if meter is not None and meter.busy():
            return "computing"
        joined = rank in up if up is not None else header is not None and header.events > 0
        if not joined and now - self.started < self.startup_s:
            return "starting"
        return None

    def _excuse(self, rank: int, why: str) -> None:
        excuse = self._excused.get(rank)
        wall = time.time()
        if excuse is None:
            excuse = self._excused[rank] = _Excuse(rank, why, self.last_event_wall, wall)
        if why == "computing":
            excuse.why = why
        excuse.until_wall = wall
        if self.where is not None and excuse.where is None:
            excuse.where = self.where(rank, not excuse.asked)
            excuse.asked = True

    def _close_excuses(self) -> None:
        for excuse in self._excused.values():
            self._notes.append(_note(excuse, still=False))
        self._excused.clear()

    def finish(self) -> None:
        """At the end of the run: a rank excused while the others waited, whose collectives
        resumed after the last poll, is no longer working "at the end"."""
        headers = [trace_file.read_header(p) if p else None for p in self.paths]
        if any(h is not None and h.events != self.events[r] for r, h in enumerate(headers)):
            self._close_excuses()

    def notes(self) -> list[str]:
        """One line per rank that kept the others waiting longer than the stall timeout
        while it worked (or started), including any still doing so now."""
        return self._notes + [_note(e, still=True) for e in self._excused.values()]

    def detection_s(self) -> float | None:
        """Seconds from the last progress any rank made to the verdict (or to now)."""
        if self.started is None:
            return None
        end = self.stalled_at if self.stalled_at is not None else time.time()
        return end - self.last_event_wall


def _note(excuse: _Excuse, *, still: bool) -> str:
    seconds = excuse.until_wall - excuse.since_wall
    tail = " (still at the end)" if still else ""
    if excuse.why == "starting":
        return (
            f"rank {excuse.rank} was still starting {seconds:.1f}s after the others began "
            f"waiting for it{tail}: not a hang"
        )
    where = f" at {excuse.where}" if excuse.where else ""
    return (
        f"rank {excuse.rank} spent {seconds:.1f}s computing{where}, outside any collective, "
        f"while the others waited{tail}: not a hang (its CPU time advanced)"
    )
