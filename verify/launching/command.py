"""`run_command`: a job as its owner launches it (`audit -- torchrun --nproc-per-node 2
train.py`, `accelerate launch ...`, `python train_lightning.py`, `python spawn_train.py`),
run as given, every process of it that joins a process group audited and watched.

The launcher owns its processes; the tool reaches them through what they inherit: their
environment (`launcher.py` starts the command with it, before the tool imports torch). Every
Python process of the command that calls `init_process_group` becomes a rank of the tool's
(`launched.py`), its files in the run's report folder under its rank number, as a torchrun
job's ranks under `verify.hang_run` leave theirs (`node_ranks.py`).

This process watches that folder as a torchrun job's node watchdog does (`jobwide.py`, the
watchdog's rule of `watching/watchdog.py` on one node): a rank's failure, a hang (a rank
waiting in a traced collective, or blocked inside torch where the trace is blind, every
rank still for the stall timeout), or every rank and the launcher ended, make the verdict;
the diagnosis is the one of every run (`watching/diagnose.py`), with the ranks that died
without a report dated by when each died (`node_ranks.DeathClock`): the first is the root
cause. At the verdict the folder is sealed (`private.seal`): a rank that ends later, or a
launcher's next attempt, leaves nothing of its end there. It then ends whatever is
left (`tree.py`: workers in sessions of their own included), also at Ctrl-C and at the
deadline; after a crash, once the launcher has had END_WAIT_S to end by itself, or as soon
as its next attempt joins (a retry, which ends only with that attempt). A command whose
processes never join a group gives no verdict: "nothing joined" (a usage error).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time

from verify import private
from verify.launching import launched, tree
from verify.launching.launcher import Started
from verify.launching.node_ranks import POLL_S, NodeRanks
from verify.launching.outcome import LaunchResult, RankOutcome
from verify.launching.supervisor import GRACE_S, root_cause_order
from verify.watching.diagnose import diagnose

SAMPLE_S = 0.25  # as a node watchdog's status period
END_WAIT_S = 10.0  # after the verdict, for the launcher to tear its workers down itself


class NothingJoined(ValueError):
    """No process of the command joined a process group: no verdict (a usage error)."""


def run_command(started: Started, *, timeout_s: float, stall_timeout_s: float) -> LaunchResult:
    """Watch the command `started` (`launcher.start`) to its end under the watchdog (module
    docstring), then end whatever is left of it; `timeout_s` from its start. Raises
    `NothingJoined` (a ValueError) when nothing of it joined a process group. (An exception
    that reaches the caller any other way, Ctrl-C before the watch began, is the caller's to
    end the command for: `Started.abandon`, as `checks/script.py` does.)"""
    launcher, report_dir = started.process, os.path.abspath(started.report_dir)
    with started.reaping:  # workers whose launcher died come to us, not to init
        watch = _Watch(report_dir, stall_timeout_s)
        try:
            try:
                reason = watch.run(launcher, started.start + timeout_s)
            finally:
                # The verdict is taken: no process of the run leaves a report after it, not a
                # rank ending late nor a launcher's next attempt (`private.seal`); what the
                # verdict rests on is read below. A failing rank waits for it, too.
                with contextlib.suppress(OSError, private.Untrusted):
                    private.seal(report_dir)
            result = watch.result(reason, time.monotonic() - started.start)
        finally:
            # After an end or a crash the launcher ends its workers its own way (and reports a
            # failure as it would have); after a hang, the deadline or Ctrl-C, it is ended now.
            polite = watch.reason in ("end", "crash")
            if polite and launcher.poll() is None:
                _await_end(launcher, report_dir)
            pids = list(watch.local.pids.values())
            tree.end_all(pids, launcher, GRACE_S if polite else 0.0, started.marker)
    if not watch.local.ranks:
        ended = (
            f"ran to the {timeout_s:g} s timeout"
            if watch.reason == "timeout"
            else f"exited with code {launcher.returncode}"
        )
        raise NothingJoined(
            f"nothing joined a process group: {' '.join(started.argv)} {ended} before any "
            "of its processes returned from init_process_group (the audit and the watchdog "
            "follow processes that do)"
        )
    return result


class _Watch:
    """The run's ranks, as they join, and the watchdog's rule over them."""

    def __init__(self, report_dir: str, stall_timeout_s: float) -> None:
        self.report_dir, self.stall_timeout_s = report_dir, stall_timeout_s
        self.local = NodeRanks(report_dir, [], stall_timeout_s)
        self.world = 0
        self.reason = ""
        self.detection_s: float | None = None
        self._events: int | None = None
        self._last_change = time.monotonic()

    def _join(self) -> None:
        """Ranks that joined since the last look (a world size is known once one has). Until
        then the folder is listed: the first to join may be any rank, as where rank 1 joins and
        dies before rank 0, slow on a loaded machine, has written its join."""
        candidates = range(self.world) if self.world else launched.joined_ranks(self.report_dir)
        for r in candidates:
            if r in self.local.ranks:
                continue
            joined = launched.read_joined(self.report_dir, r)
            if joined is not None:
                self.world = max(self.world, joined[0])
                self.local.ranks.append(r)
                self.local.pids[r] = joined[1]
        self.local.ranks.sort()

    def run(self, launcher: subprocess.Popen, deadline: float) -> str:
        """Watch until a verdict: "crash", "hang", "end" or "timeout"."""
        start, sampled = time.monotonic(), 0.0
        while True:
            now = time.monotonic()
            self._join()
            self.local.note_deaths()
            if self.local.failed():
                return self._set("crash")
            if now >= deadline:
                return self._set("timeout")
            code = launcher.poll()
            if not self.local.ranks:
                if code is not None:
                    return self._set("end")
            elif now - sampled >= SAMPLE_S:
                sampled = now
                if self._judge(self.local.status(now - start), now, code is not None):
                    return self.reason
            time.sleep(POLL_S)

    def _set(self, reason: str) -> str:
        self.reason = reason
        return reason

    def _judge(self, status, now: float, launcher_ended: bool) -> bool:
        """The node watchdog's rule (`jobwide.NodeWatch._judge`) over this one node."""
        if status.events != self._events:
            self._events, self._last_change = status.events, now
        if status.ended and launcher_ended:  # (a rank that never joined ended with it)
            return bool(self._set("end"))
        if status.ended and len(self.local.ranks) >= self.world:
            # The launcher is still tearing down, or runs processes of its own that are not
            # the run's (an evaluation phase spawned after training): never ended for it.
            return False
        if now - self._last_change < self.stall_timeout_s or status.busy:
            return False
        if status.waiting:
            last = status.last_event
            self.detection_s = time.time() - last if last else now - self._last_change
            return bool(self._set("hang"))
        still = status.still_s
        if still is not None and still >= self.stall_timeout_s and status.blocked:
            self.detection_s = still
            return bool(self._set("hang"))
        return False

    def result(self, reason: str, elapsed_s: float) -> LaunchResult:
        """What the ranks left, read before any is ended: the diagnosis of the run as it
        stood (the stacks of those still running are dumped now)."""
        self._join()
        if not self.local.ranks:
            return LaunchResult(0, (), elapsed_s)
        report = self.local.report(
            "end" if reason == "timeout" else reason, 0, socket.gethostname()
        )
        outcomes, traces = [], []
        for r in range(self.world):
            outcome = report.outcomes.get(r) or RankOutcome(
                r, "killed", error="never joined the process group the others joined"
            )
            if reason == "timeout" and outcome.status == "killed":
                outcome = RankOutcome(r, "timeout", error="still running", stack=outcome.stack)
            outcomes.append(outcome)
            traces.append(report.traces.get(r))
        failures = [(t, r) for r, t in report.failed_at.items()]
        order = root_cause_order(failures, outcomes)
        diag = diagnose(
            traces, outcomes, stalled=reason == "hang", failure_order=order,
            stall_timeout_s=self.stall_timeout_s, detection_s=self.detection_s,
            timed_out=reason == "timeout" and not order,
        )  # fmt: skip
        return LaunchResult(
            self.world, tuple(outcomes), elapsed_s, timed_out=reason == "timeout",
            failure_order=order, stalled=reason == "hang", diagnosis=diag,
            report_dir=self.report_dir,
        )  # fmt: skip


def _await_end(launcher: subprocess.Popen, report_dir: str) -> None:
    """Give the launcher END_WAIT_S to end by itself, and no longer than until a process of its
    next attempt joins (`launched.started_again`): a launcher that answers a failure by
    starting its workers again (torchrun `--max-restarts`, a script that retries `mp.spawn`)
    has said why before it started them, and ends only with that attempt, which is not the
    run's (unwatched): it is ended now, with the same verdict."""
    end = time.monotonic() + END_WAIT_S
    while launcher.poll() is None and time.monotonic() < end:
        with contextlib.suppress(OSError, private.Untrusted):
            if launched.started_again(report_dir):
                return
        time.sleep(POLL_S)
