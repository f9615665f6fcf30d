"""The one supervisor: watches a set of ranks until they are done, one failed, the run hung,
or the time ran out, then ends every one of them.

`supervise(ranks, ...)` polls the ranks' report pipes and exits (every 50 ms) and, when a
watchdog is given, their trace headers and CPU time (`watching/watchdog.py`):

- a rank that reports its value, or its traceback, is done; one that exits without a report
  has crashed. After the first failure the others get `GRACE_S` to fail or finish too (their
  sockets close, gloo errors out within milliseconds), then are ended;
- the deadline: for a function, `timeout_s` from the moment every rank has joined the
  process group (starting interpreters on a crowded machine is not the function's time; the
  start has `startup_s`, extended while a rank that is not up yet still uses CPU); for a
  script, `timeout_s` from the start;
- the watchdog's hang verdict ends the run, rather than the deadline, once the ranks' stacks
  are dumped and one more poll brought no failure: a rank whose peer's exit closed its
  connection just then raises, says it is `Failing`, and the run is a crash, not a hang. A
  rank that says it is failing stops the watchdog; it gets `FAILING_S`, and up to
  `FAILING_CAP_S` while it uses CPU, to send its report: one that sends none is a crash all
  the same, dated when it said it raised;
- `interrupt()` (the CLI's Ctrl-C or SIGTERM) ends every supervised run in every thread
  within one poll, and refuses new ones: `Interrupted` is raised in each.

At the end, ranks still running are asked for a faulthandler dump of every thread (SIGUSR1;
and for the flight recorder's dump when a report is kept), then ended: SIGTERM, SIGKILL, and
their sessions killed, so nothing is left running.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from dataclasses import dataclass, field

from verify import private, progress
from verify.launching.outcome import Failing, RankOutcome, RankReport, Say, Up
from verify.launching.process import RankProcess
from verify.watching import capture, stacks
from verify.watching.procstat import CpuMeter
from verify.watching.ranks import is_echo
from verify.watching.watchdog import STARTUP_S, Watchdog

GRACE_S = 1.5  # after a failure, peers usually error out within ms (their sockets close)
POLL_S = 0.05
STARTUP_CAP_S = 600.0  # however much CPU a starting rank keeps using
EXIT_WAIT_S = 5.0  # ranks that reported may take a moment to tear down and exit
# How long the ranks asked for a stack dump may take to write it: milliseconds when idle, but
# a rank on a crowded machine may not run for a while (a CI run saw an empty dump after 0.5 s,
# and a hang left unexplained). The wait ends as soon as every dump is written.
_STACK_WAIT_S = 2.0
# A rank that said it is failing saves what its set-ups found, then formats its report;
# while it still uses CPU (its tree's: a data loader's workers count) it gets more time.
FAILING_S = 10.0
FAILING_CAP_S = 60.0
_INTERRUPTED = threading.Event()


class Interrupted(KeyboardInterrupt):
    """The tool was interrupted (Ctrl-C, SIGTERM): every rank has been ended."""


def interrupt() -> None:
    """End every supervised run in this process, in every thread, and refuse new ones."""
    _INTERRUPTED.set()


def reset_interrupt() -> None:
    """Accept runs again (a new command in the same process, after an interrupted one)."""
    _INTERRUPTED.clear()


def interrupted() -> bool:
    return _INTERRUPTED.is_set()


def check_interrupted() -> None:
    if _INTERRUPTED.is_set():
        raise Interrupted()


@dataclass(frozen=True)
class Supervision:
    """How the supervised run ended; `outcomes` lack exit codes and stderr (filled by the
    caller once the ranks are reaped)."""

    outcomes: tuple[RankOutcome, ...]
    failure_order: tuple[int, ...]
    timed_out: bool
    stalled: bool
    notes: tuple[str, ...]


def supervise(
    ranks: list[RankProcess],
    *,
    timeout_s: float,
    clock_from_up: bool,
    stack_paths: list[str],
    watchdog: Watchdog | None = None,
    report_dir: str | None = None,
) -> Supervision:
    """Watch `ranks` (already started) to the end; see the module docstring. Every rank is
    still to be ended by the caller (`RankProcess.end`), also when this raises."""
    watch = _Watch(ranks, timeout_s, clock_from_up, stack_paths, watchdog)
    while None in watch.outcomes:
        check_interrupted()
        now = time.monotonic()
        if now >= watch.grace_end or now >= watch.deadline:  # time or grace is up
            if watch.extended(now):
                continue
            break
        watch.sample(now)
        if watch.hung(now):
            break
        watch.poll()
    return watch.settle(report_dir)


@dataclass
class _Watch:
    """The state of one `supervise` loop, whose steps are its methods: what each rank said,
    the clocks, and the stacks dumped at a hang. Rank r is `ranks[r]`."""

    ranks: list[RankProcess]
    timeout_s: float
    clock_from_up: bool
    stack_paths: list[str]
    watchdog: Watchdog | None
    outcomes: list[RankOutcome | None] = field(init=False)
    failures: list[tuple[float, int]] = field(default_factory=list)  # (wall time, rank)
    up: set[int] = field(default_factory=set)
    start: float = field(default_factory=time.monotonic)
    deadline: float = field(init=False)
    grace_end: float = float("inf")
    meters: dict[int, CpuMeter] = field(init=False)
    sampled: float = 0.0
    stalled: bool = False
    failing: dict[int, float] = field(default_factory=dict)  # rank -> when it said it raised
    dumps: dict[int, str | None] = field(default_factory=dict)  # rank -> its last stack dump
    dumped: dict[int, int] = field(default_factory=dict)  # each stack file's size after a hang's

    def __post_init__(self) -> None:
        self.outcomes = [None] * len(self.ranks)
        self.deadline = self.start + (STARTUP_S if self.clock_from_up else self.timeout_s)
        self.meters = {r.rank: CpuMeter(r.pid) for r in self.ranks if r.pid is not None}

    def extended(self, now: float) -> bool:
        """Past the grace or the deadline: whether a rank still at work earns one more second
        (one that said it is failing, writing its report within `FAILING_CAP_S` and the
        deadline; one not up yet, within `STARTUP_CAP_S`). False: the run ends."""
        if now >= self.grace_end:
            cap = time.time() - FAILING_CAP_S
            writing = [r for r, t in self.failing.items() if self.outcomes[r] is None and t > cap]
            if now < self.deadline and self._busy(writing):
                self.grace_end = now + 1.0
                return True
            return False
        starting = [r for r, o in enumerate(self.outcomes) if r not in self.up and o is None]
        if self.clock_from_up and starting and now - self.start < STARTUP_CAP_S:
            if self._busy(starting):
                self.deadline = now + 1.0  # still importing or meeting: give it time
                return True
        return False

    def _busy(self, ranks: list[int]) -> bool:
        return any(self.meters[r].busy() for r in ranks if r in self.meters)

    def sample(self, now: float) -> None:
        """Sample the ranks' CPU time, every 0.25 s at most."""
        if now - self.sampled >= 0.25:
            self.sampled = now
            for meter in self.meters.values():
                meter.sample(now)

    def hung(self, now: float) -> bool:
        """Whether the watchdog's hang verdict ends the run now. At its verdict the stacks are
        dumped and this says False, so that one more poll may bring a failure (a rank whose
        peer's exit closed its connection just then: a crash); True at the next call. Never
        while a rank failed or said it is failing."""
        if self.watchdog is None or self.failures or self.failing:
            return False
        if self.stalled:  # the poll after the dumps brought no failure: hung
            return True
        ranks = self.ranks
        pids = [r.pid if self.outcomes[r.rank] is None and r.running() else None for r in ranks]
        if self.watchdog.poll(pids, now, self.up):
            self.stalled = True
            self.dumps = _dump_stacks([r for r, pid in zip(ranks, pids) if pid], self.stack_paths)
            self.dumped = {r: _size(path) for r, path in enumerate(self.stack_paths)}
        return False

    def poll(self) -> None:
        """Wait up to `POLL_S` for the ranks' messages and take them; a rank that exited
        without a report has crashed. After a failure, the others get `GRACE_S`."""
        pending = [r for r in self.ranks if self.outcomes[r.rank] is None]
        fds = [r.fd for r in pending if r.fd is not None and not r.eof]
        if fds:
            select.select(fds, [], [], POLL_S)
        else:
            time.sleep(POLL_S)
        # A crash is only known to have happened after the previous poll; dating it there
        # keeps it ahead of the "connection closed by peer" errors it causes in the others.
        alive_at = time.time()
        for r in pending:
            # Sampled before draining: a rank that had exited by now has all it sent in the
            # pipe, so only one that really never reported is declared crashed below.
            exited = not r.running()
            for msg in r.messages():
                if self._take(r, msg):
                    break
            if self.outcomes[r.rank] is None and exited:
                why = stacks.describe_exit(r.exitcode) + " before reporting"
                # faulthandler wrote there on a fatal signal (after a withdrawn hang's dump)
                stack = _read(self.stack_paths[r.rank], after=self.dumped.get(r.rank, 0))
                self.outcomes[r.rank] = RankOutcome(r.rank, "crashed", error=why, stack=stack)
                self.failures.append((alive_at, r.rank))
        if self.failures:
            self.stalled = False  # a rank failed as the stall was called: a crash
            self.grace_end = min(self.grace_end, time.monotonic() + GRACE_S)

    def _take(self, r: RankProcess, msg) -> bool:
        """Take one message of rank `r`; True when it was its report (its outcome is set)."""
        if isinstance(msg, Say):
            progress.say(msg.task, msg.done, msg.total, msg.after)
            return False
        if isinstance(msg, Failing):
            self.failing[r.rank] = time.time()
            self.stalled = False
            self.grace_end = min(self.grace_end, time.monotonic() + FAILING_S)
            return False
        if isinstance(msg, Up):
            self.up.add(r.rank)
            if self.clock_from_up and len(self.up) == len(self.ranks):  # fn's clock starts now
                self.deadline = time.monotonic() + self.timeout_s
            return False
        self.outcomes[r.rank], failed_at = _outcome(r, msg)
        if failed_at is not None:  # a slow report is dated when the rank raised
            self.failures.append((min(failed_at, self.failing.get(r.rank, failed_at)), r.rank))
        return True

    def settle(self, report_dir: str | None) -> Supervision:
        """After the loop: dump the stacks of the ranks still running (and the flight
        recorder's, into `report_dir`), give every rank left without an outcome one (a
        failing rank that sent no report crashed; the rest were killed or timed out), and
        let ranks that all reported exit on their own (up to `EXIT_WAIT_S`)."""
        leftover = [r for r, o in enumerate(self.outcomes) if o is None]
        reported = not leftover
        live = [r for r in leftover if self.ranks[r].running()]
        if report_dir is not None and live:
            capture.helpers(report_dir).flight_recorder(live)
        if not self.stalled:  # (a hang's were dumped when it was called)
            self.dumps = _dump_stacks([self.ranks[r] for r in live], self.stack_paths)
        for r, said_at in self.failing.items():
            if self.outcomes[r] is None:  # raised, but its report never came: a crash all the same
                why = f"raised, and sent no report within {time.time() - said_at:.0f}s"
                self.outcomes[r] = RankOutcome(r, "crashed", error=why, stack=self._stack(r))
                self.failures.append((said_at, r))
                leftover.remove(r)
        order = root_cause_order(self.failures, self.outcomes)
        timed_out = bool(leftover) and not self.failures and not self.stalled
        for r in leftover:
            status = "killed" if self.failures else "timeout"
            why = self._why_left(order)
            self.outcomes[r] = RankOutcome(r, status, error=why, stack=self._stack(r))
        if reported:  # every rank reported: let them tear down and exit on their own
            until = time.monotonic() + EXIT_WAIT_S
            for rank in self.ranks:
                while rank.running() and time.monotonic() < until:
                    time.sleep(POLL_S)
        notes = ()
        if self.watchdog is not None:
            self.watchdog.finish()
            notes = tuple(self.watchdog.notes())
        return Supervision(tuple(self.outcomes), order, timed_out, self.stalled, notes)

    def _stack(self, r: int) -> str | None:
        return self.dumps.get(r) or _read(self.stack_paths[r])

    def _why_left(self, order: tuple[int, ...]) -> str:
        """Why a rank still running at the end was ended."""
        if self.stalled:
            return f"no rank progressed for {self.watchdog.stall_timeout_s:g}s (stall timeout)"
        if self.failures:
            return f"still running {GRACE_S:g}s after rank {order[0]} failed"
        if self.clock_from_up and len(self.up) < len(self.ranks):
            return f"the ranks were not all up after {time.monotonic() - self.start:.0f}s"
        since = "all ranks were up" if self.clock_from_up else "the start"
        return f"still running {self.timeout_s:g}s after {since}"


def _outcome(rank: RankProcess, report: RankReport) -> tuple[RankOutcome, float | None]:
    """A rank's report as (outcome, failure time or None)."""
    outcome = report.outcome(rank.rank, rank.pid)
    if outcome.status == "ok":
        return outcome, None
    return outcome, report.failed_at if not report.ok else time.time()


def root_cause_order(failures: list[tuple[float, int]], outcomes) -> tuple[int, ...]:
    """Failed ranks, root cause first: by time, except that a collective which failed because
    a peer vanished is an echo of that peer's failure, so it goes last whatever its time."""
    key = {r: (is_echo(outcomes[r].error), t) for t, r in failures}
    return tuple(sorted(key, key=key.__getitem__))


def _dump_stacks(ranks: list[RankProcess], stack_paths: list[str]) -> dict[int, str | None]:
    """Ask each live rank for a faulthandler dump of all its threads, then read them."""
    asked, old = [], []  # a file may hold an earlier dump: this one is written once it grew
    for r in ranks:
        size = _size(stack_paths[r.rank])
        # The file appears only once the handler is registered: before that, SIGUSR1 kills.
        if os.path.exists(stack_paths[r.rank]) and r.signal(signal.SIGUSR1):
            asked.append(r.rank)
            old.append(size)
    end, sizes = time.monotonic() + _STACK_WAIT_S, None
    while asked and time.monotonic() < end:
        time.sleep(0.05)
        sizes, before = [_size(stack_paths[r]) for r in asked], sizes
        if all(map(int.__gt__, sizes, old)) and sizes == before:  # grew, then stopped
            break
    return {r.rank: _read(stack_paths[r.rank]) for r in ranks}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, after: int = 0) -> str | None:
    """A stack dump's text from byte `after` on (None: there is none); `private.Untrusted` if
    it is not this user's alone: where a rank is decides a verdict."""
    try:
        return (private.read_path(path, after=after) or b"").decode(errors="replace") or None
    except OSError:
        return None
