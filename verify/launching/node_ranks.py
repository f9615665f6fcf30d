"""This node's ranks in a torchrun job that spans nodes: what the node watchdog
(`jobwide.py`) reads of them and how it ends them.

The ranks of a node share its report folder, and tell the watchdog (a thread of LOCAL_RANK
0) how they ended through files there, since a rank's process may be gone by the time the
watchdog looks: `rank<r>.up` (the script's `init_process_group` returned, `rank_up`: a rank
whose collectives PyTorch DDP issues from C++ records none, and without it would read as
starting), `rank<r>.failing` (the rank raised and is writing its report, `rank_failing`:
for `FAILING_S` it reads as busy, never hung; a rank that leaves no failure by then, or by
`FAILING_CAP_S` while it uses CPU, has crashed), `rank<r>.failed` (the failure, left by
`rank_failed` before the traceback is printed), `rank<r>.ended` (the script returned,
`rank_ended`). The watchdog leaves `job.diagnosed` once the job's verdict is out, which a
failing rank waits for (bounded), so that the diagnosis comes before the raw error; it is also
the folder's seal: no rank leaves a message after it (`verify/private.py`).

These messages are JSON (or a line of text), read and written through `verify/private.py`: the folder
and each file must be this user's alone, so a message another user planted is refused, never
read. A rank dead without a message is dated from when its process ended (`DeathClock`),
so that the first to die is the root cause, whatever order the ranks are numbered in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import threading
import time
from dataclasses import dataclass, replace

from verify import private
from verify.launching.env import DIAGNOSED
from verify.launching.outcome import RankOutcome, RankReport
from verify.launching.process import alive
from verify.launching.supervisor import FAILING_CAP_S, FAILING_S, GRACE_S
from verify.watching import capture, trace_file
from verify.watching.blind import Stillness
from verify.watching.findings import Diagnosis
from verify.watching.procstat import CpuMeter
from verify.watching.stacks import at
from verify.watching.trace_file import Trace
from verify.watching.watchdog import STARTUP_S

TAIL = 256  # records per rank sent at a verdict (the history a skip is recognised by)
WAIT_S = 12.0  # how long a failing rank waits for the job's diagnosis before its traceback
POLL_S = 0.1
_STACK_WAIT_S = 0.5


@dataclass(frozen=True)
class NodeStatus:
    """What one node says every SAMPLE_S (a few dozen bytes: the job's store carries one per
    node and period, and only rank 0's node reads them)."""

    events: int  # issues and completions of its ranks' collectives
    waiting: bool  # one of its ranks waits in a collective
    busy: bool  # one of its ranks works (CPU) or starts outside any collective
    ended: bool  # every rank of the node has ended
    last_event: float  # wall clock (this node's) of its ranks' last issue or completion
    # Where the trace is blind (`watching/blind.py`): how long every live rank of the node
    # not waiting in a traced collective has been still (None: one is not; inf: none is
    # left), and whether one of them is blocked inside torch's C++.
    still_s: float | None = None
    blocked: bool = False


class DeathClock:
    """When each watched process ended, within milliseconds whatever the watcher's polling:
    a daemon thread waits on their pidfds (Linux 5.3 and later) and stamps each as it becomes
    readable. Which rank died first names the root cause: ranks killed by a signal leave no
    report, and the launcher ends the others right after the first."""

    def __init__(self) -> None:
        self._at: dict[int, float] = {}
        self._fds: dict[int, int] = {}  # pidfd -> key
        self._keys: dict[int, int] = {}  # key -> pid watched
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, key: int, pid: int) -> None:
        """Watch process `pid` under `key` (once a key and process; where pidfds are not
        available, nothing: `ended_at` then gives its default)."""
        with self._lock:
            if self._keys.get(key) == pid or pid == os.getpid():  # (its own end is not seen)
                return
            self._keys[key] = pid
            try:
                self._fds[os.pidfd_open(pid)] = key
            except (AttributeError, OSError):  # no pidfds here, or the process is gone
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ddp-verify-deaths",
                                                daemon=True)  # fmt: skip
                self._thread.start()

    def ended_at(self, key: int, default: float) -> float:
        with self._lock:
            return self._at.get(key, default)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._fds:
                    self._thread = None
                    return
                fds = list(self._fds)
            ready, _, _ = select.select(fds, [], [], 0.02)  # new processes join each round
            now = time.time()
            with self._lock:
                for fd in ready:
                    self._at.setdefault(self._fds.pop(fd), now)
                    os.close(fd)


@dataclass(frozen=True)
class NodeReport:
    """A node's answer at a verdict: its ranks' last TAIL records and how each ended."""

    node: int
    host: str
    traces: dict[int, Trace | None]
    outcomes: dict[int, RankOutcome]
    failed_at: dict[int, float]  # wall clock of each failure (root cause first, as on one node)


class NodeRanks:
    """The ranks `ranks` of this node, whose files are in `report_dir`."""

    def __init__(self, report_dir: str, ranks: list[int], stall_timeout_s: float) -> None:
        self.report_dir, self.ranks = report_dir, ranks
        self.pids: dict[int, int] = {}
        self.died_at: dict[int, float] = {}  # wall clock a rank was first seen dead
        self._clock = DeathClock()
        self._meters: dict[int, CpuMeter] = {}
        self._still = Stillness(capture.helpers(report_dir).in_torch, stall_timeout_s / 2)
        self._events = 0
        # A mark older than this is not this attempt's rank raising. (Under verify.hang_run a
        # folder is one attempt's, `torchrun.script_report_dir`; the launcher form's run
        # folder is the tool run's, which a launcher's own restarts would share.)
        self._since = time.time()

    def _path(self, r: int, what: str) -> str:
        return os.path.join(self.report_dir, f"rank{r}.{what}")

    def _has(self, r: int, what: str) -> bool:
        return private.read(self.report_dir, f"rank{r}.{what}") is not None

    def failed(self) -> bool:
        return any(self._has(r, "failed") or self._gave_up(r) for r in self.ranks)

    def note_deaths(self) -> None:
        """Date each rank found dead (`died_at`): when its process ended (`DeathClock`), or,
        where that is not known, now (call it often)."""
        now = time.time()
        for r, pid in self.pids.items():
            self._clock.watch(r, pid)
            if r not in self.died_at and not alive(pid):
                self.died_at[r] = self._clock.ended_at(r, now)

    def _failing_since(self, r: int) -> float | None:
        """When rank r said it raised (`rank_failing`) in this attempt; None if it has not."""
        said = _load(self.report_dir, f"rank{r}.failing")
        return said if isinstance(said, float) and said >= self._since else None

    def _gave_up(self, r: int) -> bool:
        """Rank r said it raised but left no failure in time: `FAILING_S`, or up to
        `FAILING_CAP_S` while it uses CPU (as `supervisor.supervise` waits)."""
        said = self._failing_since(r)
        if said is None or time.time() - said < FAILING_S or self.ended(r):
            return False
        meter = self._meters.get(r)
        busy = meter is not None and meter.busy()
        return time.time() - said >= FAILING_CAP_S or not busy

    def _meter(self, r: int, pid: int | None, now: float) -> CpuMeter | None:
        """Rank r's CPU meter, sampled now (None before its trace names its process)."""
        meter = self._meters.get(r)
        if pid is not None and (meter is None or meter.pid != pid):
            meter = self._meters[r] = CpuMeter(pid)
        if meter is not None:
            meter.sample(now)
        return meter

    def ended(self, r: int) -> bool:
        if self._has(r, "failed") or self._has(r, "ended"):
            return True
        pid = self.pids.get(r)
        return pid is not None and not alive(pid)

    def status(self, up_s: float) -> NodeStatus:
        """The watchdog's three conditions, for this node (`watching/watchdog.py`), and
        where the trace is blind, how long its ranks have been still (`watching/blind.py`)."""
        now = time.monotonic()
        headers = {r: trace_file.read_header(self._path(r, "trace")) for r in self.ranks}
        self.pids.update({r: h.pid for r, h in headers.items() if h is not None})
        self.note_deaths()
        live = [r for r in self.ranks if not self.ended(r)]
        waiting = any(headers[r] is not None and headers[r].pending for r in live)
        busy, blocked, still = False, False, []
        for r in self.ranks:
            h = headers[r]
            said = self._failing_since(r) if r in live else None
            failing = said is not None and time.time() - said < FAILING_S
            if r not in live or (h is not None and h.pending):
                self._still.drop(r)
                if said is not None:  # raised with a collective open: writing its failure
                    meter = self._meter(r, h.pid if h else None, now)
                    busy = busy or failing or (meter is not None and meter.busy())
                continue
            meter = self._meter(r, h.pid if h else None, now)
            self._still.sample(r, meter, now)
            joined = (h is not None and h.events > 0) or self._has(r, "up")
            starting = not joined and up_s < STARTUP_S
            busy = busy or starting or failing or (meter is not None and meter.busy())
            still.append(self._still.still_s(r, now))
            blocked = blocked or bool(self._still.blocked(r))
        events = sum(h.events for h in headers.values() if h is not None)
        if events != self._events:
            self._still.moved()  # a collective moved: ask again where the ranks are
        self._events = events
        last = max((h.last_event for h in headers.values() if h is not None), default=0.0)
        still_s = None if None in still else min(still, default=float("inf"))
        return NodeStatus(events, waiting, busy, not live, last, still_s, blocked)

    def positions(self) -> dict[int, str]:
        """Where each rank is, in words: its last collective, and that one's state."""
        out = {}
        for r in self.ranks:
            trace = trace_file.read_trace(self._path(r, "trace"), 1)
            if trace is not None and trace.records:
                rec = trace.records[-1]
                out[r] = f"{rec.describe()} {at(rec.site)} ({rec.state})"
        return out

    def report(self, reason: str, node: int, host: str) -> NodeReport:
        """At a verdict ("hang", "crash" or "end"): the stacks of the ranks still running,
        then every rank's last TAIL records and how it ended."""
        live = [r for r in self.ranks if r in self.pids and not self.ended(r)]
        for r in live:  # each dumps its stack into rank<r>.stack (faulthandler, SIGUSR1)
            if self.pids[r] == os.getpid():
                with os.fdopen(private.create(self._path(r, "stack")), "w") as f:
                    faulthandler.dump_traceback(f, all_threads=True)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pids[r], signal.SIGUSR1)
        time.sleep(_STACK_WAIT_S if live else 0)
        self.note_deaths()
        outcomes, failed_at = {}, {}
        for r in self.ranks:
            stack = _text(self._path(r, "stack"))
            failed = _load(self.report_dir, f"rank{r}.failed")
            said = self._failing_since(r)  # a failure is dated from the raise, as on one machine
            if failed is not None:
                error, tb, failed_at[r] = _failure(failed, self._path(r, "failed"))
                failed_at[r] = min(failed_at[r], said or failed_at[r])
                outcomes[r] = RankOutcome(r, "error", error=error, traceback=tb)
            elif self._has(r, "ended"):
                outcomes[r] = RankOutcome(r, "ok")
            elif said is not None and r in live:  # its failure not written (yet): a crash
                why = f"raised, and sent no report within {time.time() - said:.0f}s"
                outcomes[r] = RankOutcome(r, "crashed", error=why, stack=stack)
                failed_at[r] = said
            elif r in live:
                status = "timeout" if reason == "hang" else "killed"
                why = "no rank of the job progressed" if reason == "hang" else "still running"
                outcomes[r] = RankOutcome(r, status, error=why, stack=stack)
            else:
                why = "exited without a report (a signal, or os._exit)"
                outcomes[r] = RankOutcome(r, "crashed", error=why, stack=stack)
                failed_at[r] = said or self.died_at.get(r, time.time())
        _after_what_ended_them(failed_at, self._terminated(), outcomes)
        traces = {r: trace_file.read_trace(self._path(r, "trace"), TAIL) for r in self.ranks}
        return NodeReport(node, host, traces, outcomes, failed_at)

    def _terminated(self) -> dict[int, int]:
        """rank -> the signal that ended it, of the ranks that said so (`rank_terminated`)."""
        found = {r: _load(self.report_dir, f"rank{r}.terminated") for r in self.ranks}
        return {r: d["signal"] for r, d in found.items() if isinstance(d, dict)
                and type(d.get("signal")) is int}  # fmt: skip

    def write(self, diag: Diagnosis, text: str) -> None:
        """The report folder: each rank's records as JSON lines, and the job's diagnosis."""
        for r in self.ranks:
            trace_file.export_jsonl(self._path(r, "trace"), self._path(r, "collectives.jsonl"))
            with contextlib.suppress(OSError):  # the helper's address: not a report
                os.remove(self._path(r, capture.ADDRESS))
        with open(os.path.join(self.report_dir, "report.json"), "w") as f:
            json.dump(diag.to_dict(), f, indent=2, default=str)
        with open(os.path.join(self.report_dir, "report.txt"), "w") as f:
            f.write(text + "\n")

    def end(self, reason: str) -> None:
        """After the verdict: failing ranks go on to print their tracebacks (below the
        diagnosis); at a hang or a crash the others are ended, this process too unless its
        own rank failed, so torchrun tears the job down now, not at the collective timeout."""
        private.seal(self.report_dir)
        if reason == "end":
            return
        time.sleep(GRACE_S if reason == "crash" else 0)  # let the failing ones print
        for r, pid in self.pids.items():
            if pid != os.getpid() and not self._has(r, "failed"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if not self._has(self.ranks[0], "failed"):
            os._exit(1)


def rank_failed(report_dir: str, rank: int):
    """The hook a failing rank calls before its traceback is printed (`RankJob.on_failure`):
    leave the failure for the node watchdog, and wait (at most WAIT_S) for the job's
    diagnosis, so that it comes first."""

    def hook(report: RankReport) -> None:
        leave_failure(report_dir, rank, report)
        await_diagnosis(report_dir)

    return hook


def leave_failure(report_dir: str, rank: int, report: RankReport) -> None:
    """Leave rank `rank`'s failure for the watchdog (nothing once the folder is sealed)."""
    failure = {"error": report.error, "traceback": report.traceback, "at": report.failed_at}
    _leave(_failed(report_dir, rank), failure)


def await_diagnosis(report_dir: str) -> None:
    """Wait (at most WAIT_S) for the job's diagnosis (`DIAGNOSED`, the seal)."""
    end = time.monotonic() + WAIT_S
    done = os.path.join(report_dir, DIAGNOSED)
    while not os.path.exists(done) and time.monotonic() < end:
        time.sleep(POLL_S)


def rank_terminated(report_dir: str, rank: int, signum: int) -> None:
    """In a rank a signal is ending (`launched.py`: SIGTERM, where the script left it at its
    default): the evidence that something else ended it, as a launcher ends the other ranks
    once one died, so it is not the root cause (`NodeRanks.report`)."""
    _leave(os.path.join(report_dir, f"rank{rank}.terminated"), {"signal": signum})


def rank_failing(report_dir: str, rank: int):
    """The hook a rank calls as soon as its script raised (`RankJob.on_failing`): its
    failure follows once its set-ups saved what they found, and the watchdog waits for it."""

    def hook() -> None:
        with contextlib.suppress(OSError):  # the failure itself must still be reported
            _leave(os.path.join(report_dir, f"rank{rank}.failing"), time.time())

    return hook


def rank_up(report_dir: str, rank: int):
    """The hook a rank calls once its script's `init_process_group` returned
    (`RankJob.on_up`): it has met its peers, and is no longer starting."""

    def hook() -> None:
        _leave(os.path.join(report_dir, f"rank{rank}.up"), None)

    return hook


def rank_ended(report_dir: str, rank: int, code) -> int:
    """In a rank whose script ended without raising, with its `sys.exit` code (None or 0
    when it returned): a non-zero code is a failure. The exit code to leave with."""
    if code in (None, 0):
        _leave(_ok(report_dir, rank), None)
        return 0
    why = f"exited with code {code}" if isinstance(code, int) else str(code)
    rank_failed(report_dir, rank)(RankReport.failure(why))
    return code if isinstance(code, int) else 1


def _failed(report_dir: str, rank: int) -> str:
    return os.path.join(report_dir, f"rank{rank}.failed")


def _ok(report_dir: str, rank: int) -> str:
    return os.path.join(report_dir, f"rank{rank}.ended")


def mark_ended(report_dir: str, rank: int) -> None:
    """`rank_ended`'s mark where its message cannot be written (a full disk): the empty
    file, whose existence is all `ended` reads."""
    private.mark(report_dir, os.path.basename(_ok(report_dir, rank)))


def _after_what_ended_them(failed_at: dict, terminated: dict, outcomes: dict) -> None:
    """Ranks a signal ended from outside, that left no report, are dated after every rank
    that died on its own: a launcher ends the others because one died, and when the watcher
    found them dead together (a loaded machine) their stamps alone do not say who was first."""
    ended = [r for r, o in outcomes.items() if r in terminated and o.status == "crashed"]
    own = [t for r, t in failed_at.items() if r not in ended]
    if not ended or not own:
        return
    for i, r in enumerate(sorted(ended, key=lambda r: failed_at.get(r, 0.0))):
        failed_at[r] = max(failed_at.get(r, 0.0), max(own) + 0.001 * (i + 1))
        why = (
            f"ended by signal {terminated[r]} from outside (its launcher ending the job), no report"
        )
        outcomes[r] = replace(outcomes[r], error=why)


def _leave(path: str, value) -> None:
    """The message `value` (JSON) at `path`; nothing once the folder is sealed."""
    private.write(os.path.dirname(path), os.path.basename(path), json.dumps(value).encode())


def _load(report_dir: str, name: str):
    """The message `name` (None: there is none, or it is not whole yet)."""
    data = private.read(report_dir, name)
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


def _failure(found, path: str) -> tuple[str, str | None, float]:
    """(error, traceback, wall clock) of a `rank<r>.failed` message."""
    if isinstance(found, dict):
        error, tb, at = found.get("error"), found.get("traceback"), found.get("at")
        if isinstance(error, str) and isinstance(tb, str | None) and isinstance(at, float):
            return error, tb, at
    raise private.Untrusted(f"{path} is not a rank's failure: refused")


def _text(path: str) -> str | None:
    """A stack dump's text (None: there is none); Untrusted if it is not this user's alone."""
    with contextlib.suppress(OSError):
        return (private.read_path(path) or b"").decode(errors="replace") or None
    return None
