"""The one rank record and the result of a launch, as data.

A launch never raises because a rank failed: every rank comes back as a `RankOutcome`, and the
`LaunchResult` says how the run ended (all returned, a rank failed, the watchdog saw a hang,
the deadline passed) with the collective-trace diagnosis beside it.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from verify.watching import stacks

if TYPE_CHECKING:
    import torch

    from verify.watching.findings import Diagnosis

#: how a rank ended
STATUSES = ("ok", "error", "crashed", "timeout", "killed")


@dataclass(frozen=True)
class RankContext:
    """What a rank function receives, after the process group is initialized."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # cpu for gloo; cuda:{local_rank} for nccl
    backend: str
    spawned: bool  # False when this process joined an existing torchrun job
    threads: int = 0  # intra-op threads this rank was given (0: not decided by the tool)


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended. `error` is a one-line reason for every status but "ok".

    status: "ok" (returned), "error" (raised: `traceback` says where), "crashed" (the process
    died without reporting: `exitcode`, and the backend's last words in `stderr`), "timeout"
    (still running at the deadline or the hang verdict: `stack` says where) or "killed" (still
    running when another rank's failure ended the run).
    """

    rank: int
    status: str
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None  # negative: killed by that signal
    stack: str | None = None  # faulthandler dump (timeout, killed, or a fatal signal)
    stderr: str | None = None  # the tail of what the rank wrote (failed ranks only)
    pid: int | None = None
    raised: dict | None = None  # "error": what was measured of the exception (`RankReport`)

    @property
    def failed(self) -> bool:
        return self.status in ("error", "crashed")

    def where(self) -> str:
        """Where the rank was: its traceback's user frame, or its stack's innermost frames."""
        if self.traceback:
            return stacks.traceback_site(self.traceback) or ""
        return stacks.innermost_frames(self.stack)


@dataclass(frozen=True)
class Raised:
    """What a rank function returns, rather than raising, when it failed after finding
    something worth reporting (a check's findings up to the failure): the launcher reports the
    rank as failed with `exc` (its error and traceback), and `found` as the partial value the
    check reads (`RankOutcome.value`), so what was found travels as a value, not as an
    attribute put on the exception (`rank_job.error_report`)."""

    exc: BaseException
    found: Any

    @staticmethod
    def unwrap(value):
        """`value`; for a `Raised`, its exception raised again (its traceback kept): what a
        caller of a rank function outside the launcher gets, as if nothing had caught it."""
        if isinstance(value, Raised):
            raise value.exc
        return value


# --- what a rank sends its parent: over its pipe (`process.send`), or the store under torchrun


@dataclass(frozen=True)
class Say:
    """A progress line for the parent to print (`verify/progress.py`'s `say` arguments)."""

    task: str
    done: int | None = None
    total: int | None = None
    after: str = ""


@dataclass(frozen=True)
class Up:
    """The rank joined the process group: a launch's clock for fn starts when all have."""


@dataclass(frozen=True)
class Failing:
    """The rank raised and is saving what its set-ups found and formatting its report: a
    failure report follows (what made a peer fail may have closed this rank's connection
    just as the watchdog called the run hung: it is a crash, not a hang)."""


@dataclass(frozen=True)
class RankReport:
    """How a rank ended, as it says itself: its last message.

    status: "ok" (`value` is fn's pickled return value), "error" (fn or the script raised, or
    exited non-zero: `error`, `traceback`, `failed_at`, and in `value` what fn had found
    before failing, pickled, when it returned a `Raised`) or
    "crashed" (a peer never reported: made by whoever waited for it).
    """

    status: str
    value: bytes | None = None
    error: str | None = None
    traceback: str | None = None
    failed_at: float | None = None  # wall clock
    # "error": the exception's type, and what the tool was calling when it rose, as the
    # rank knew them (`exc.ddp_verify`, set by the trainer): typed, for the failure's hint
    raised: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def failure(cls, why: str, status: str = "error") -> RankReport:
        return cls(status, error=why, failed_at=time.time())

    def outcome(self, rank: int, pid: int | None = None) -> RankOutcome:
        """As the parent records it, the value unpickled; a value that cannot be unpickled
        here makes an "error" outcome (and `failed_at` then says when that was found)."""
        if self.ok:
            try:
                return RankOutcome(rank, "ok", value=pickle.loads(self.value), pid=pid)
            except Exception as exc:
                why = f"the return value could not be unpickled here: {one_line(exc)}"
                return RankOutcome(rank, "error", error=why, pid=pid)
        partial = None
        if self.value is not None:
            with contextlib.suppress(Exception):
                partial = pickle.loads(self.value)
        return RankOutcome(
            rank, self.status, value=partial, error=self.error, traceback=self.traceback, pid=pid,
            raised=self.raised,
        )  # fmt: skip


@dataclass(frozen=True)
class LaunchResult:
    """Every rank's outcome and how the run ended.

    `timed_out`: the deadline passed with ranks still running and no rank failed (the check
    could not decide); `stalled`: the watchdog declared a hang; `failure_order`: the ranks that
    raised or crashed, root cause first; `notes`: ranks that kept the others waiting while they
    worked (never a failure); `threads`: the thread budget the ranks were given.
    """

    world_size: int
    outcomes: tuple[RankOutcome, ...]  # indexed by rank
    elapsed_s: float
    timed_out: bool = False
    failure_order: tuple[int, ...] = ()
    stalled: bool = False
    diagnosis: Diagnosis | None = None  # from the collective traces (None: tracing was off)
    notes: tuple[str, ...] = ()
    threads: str = ""
    report_dir: str | None = None
    files: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(o.status == "ok" for o in self.outcomes)

    @property
    def values(self) -> list:
        if not self.ok:
            raise RuntimeError(self.summary())
        return [o.value for o in self.outcomes]

    @property
    def first_failure(self) -> RankOutcome | None:
        """The root cause: the rank that failed first, not the ones killed after it."""
        if self.failure_order:
            return self.outcomes[self.failure_order[0]]
        failed = [o for o in self.outcomes if o.status != "ok"]  # a timeout: lowest rank
        return min(failed, key=lambda o: (o.status == "killed", o.rank), default=None)

    def summary(self) -> str:
        """A short diagnosis: which rank failed how and where."""
        diag = self.diagnosis
        if self.ok:
            ok = f"ok: {self.world_size} rank(s) finished in {self.elapsed_s:.1f}s"
            return ok + (f"\nbut {diag.text()}" if diag is not None and diag.faulty else "")
        if self.stalled and diag is not None:
            return diag.text()
        base = self._failure_summary()
        if diag is not None and diag.faulty and diag.collective is not None:
            root = self.first_failure
            if root is not None and root.status == "crashed" and diag.culprit is not None:
                # The backend killed a victim of the ranks' mismatch: the first line (every
                # check's headline) names the mismatch and its culprit, not the victim.
                return f"{diag.headline}\n{base}\n{TRACE_SAYS} {diag.text()}"
            return f"{base}\n{TRACE_SAYS} {diag.text()}"
        return base

    def _failure_summary(self) -> str:
        if self.timed_out:
            lines = [
                "timed out before a verdict",
                f"each rank was at ({self.elapsed_s:.1f}s in all, starting included):",
            ]
            for o in self.outcomes:
                where = stacks.innermost_frames(o.stack) or o.error or ""
                lines.append(f"  rank {o.rank} [{o.status}]: {where}")
            return "\n".join(lines + [f"note: {n}" for n in self.notes])
        root = self.first_failure
        assert root is not None
        lines = [f"rank {root.rank} failed ({root.status}): {root.error}"]
        if root.traceback:
            lines += stacks.traceback_lines(root.traceback)
        elif root.stack:
            lines.append(f"  at {stacks.innermost_frames(root.stack)}")
        if root.stderr and not root.traceback:
            # A rank killed by the backend (gloo's enforce failures abort the process) says why
            # only on its stderr.
            lines.append("  its stderr ended with:")
            lines += [f"    {line}" for line in stacks.last_lines(root.stderr)]
        others = [f"rank {o.rank} {_ENDED[o.status]}" for o in self.outcomes if o.rank != root.rank]
        return "\n".join(lines + (["other ranks: " + ", ".join(others)] if others else []))


TRACE_SAYS = "collective trace says:"  # how summary() cites the diagnosis
# how the other ranks ended, after the first failure
_ENDED = {"ok": "finished", "error": "raised", "crashed": "crashed", "timeout": "was still running",
          "killed": "was ended by the tool"}  # fmt: skip


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`: how a rank's exception is named in a report."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__
