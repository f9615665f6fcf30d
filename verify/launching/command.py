"""`run_command`: a job as its owner launches it (`audit -- torchrun --nproc-per-node 2
train.py`, `accelerate launch ...`, `python train_lightning.py`, `python spawn_train.py`),
run as given, every process of it that joins a process group audited and watched.

The launcher owns its processes; the tool reaches them through what they inherit: their
environment. `bootstrap/` goes first on PYTHONPATH, and in every Python process of the
command arms a hook that does nothing until the process calls `init_process_group`; from
then on it is a rank of the tool's (`launched.py`), its files in the run's report folder
under its rank number, as a torchrun job's ranks under `verify.hang_run` leave theirs
(`node_ranks.py`). Nothing else is set: not torchrun's variables (Lightning starts its
other ranks only when LOCAL_RANK is unset), not the ranks' threads.

This process watches that folder as a torchrun job's node watchdog does (`jobwide.py`, the
watchdog's rule of `watching/watchdog.py` on one node): a rank's failure, a hang (a rank
waiting in a traced collective, or blocked inside torch where the trace is blind, every
rank still for the stall timeout), or every rank and the launcher ended, make the verdict;
the diagnosis is the one of every run (`watching/diagnose.py`). It then ends whatever is
left (`tree.py`: workers in sessions of their own included), also at Ctrl-C and at the
deadline. A command whose processes never join a group gives no verdict: "nothing joined"
(a usage error).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from typing import TextIO

from verify.launching import launched, tree
from verify.launching.env import (
    LAUNCHED_AUDIT_ENV,
    LAUNCHED_ENV,
    LAUNCHED_ON_CPU_ENV,
    LAUNCHED_SANITIZE_ENV,
    STALL_ENV,
)
from verify.launching.node_ranks import POLL_S, NodeRanks
from verify.launching.outcome import LaunchResult, RankOutcome
from verify.launching.supervisor import GRACE_S, root_cause_order
from verify.watching.diagnose import diagnose

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE_S = 0.25  # as a node watchdog's status period
_CONSOLE_LOGGING = ("TORCH_CPP_LOG_LEVEL", "TORCH_DISTRIBUTED_DEBUG")
END_WAIT_S = 10.0  # after the verdict, for the launcher to tear its workers down itself


def is_command(argv: tuple[str, ...]) -> bool:
    """What follows `--` is a command (a launcher, `python x.py`), not a script to run under
    `--nproc`: its first word is not a .py file."""
    return bool(argv) and not argv[0].endswith(".py")


def run_command(
    argv: tuple[str, ...],
    *,
    report_dir: str,
    stall_timeout_s: float,
    timeout_s: float,
    env: dict[str, str] | None = None,
    console: TextIO | None = None,
    sanitize: bool = False,
    audit_every: int | None = None,
    on_cpu: int = 0,
) -> LaunchResult:
    """Run the command `argv` to its end under the watchdog (module docstring); the same
    arguments as `script.run_script` but the ranks, which the launcher decides. `on_cpu` (0: off):
    every Python process of the command rehearses CUDA on the CPU from its import of torch, as
    `bootstrap/` says, on a node of `on_cpu` GPUs (what `torch.cuda.device_count()` answers
    in a process that is no rank yet). Raises
    ValueError when the command is not found or nothing of it joined a process group."""
    if shutil.which(argv[0]) is None:
        raise ValueError(
            f"command {argv[0]!r} not found: after -- give a launcher command on PATH "
            "(torchrun ..., accelerate launch ..., python train.py) or, with --nproc N, "
            "a script train.py"
        )
    # The backend's logging at INFO goes, under --nproc, to the ranks' files; here the output
    # is the launcher's own, on the console: it stays as the user would see it.
    env = {k: v for k, v in (env or {}).items() if k not in _CONSOLE_LOGGING}
    path = [BOOTSTRAP, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), _ROOT]
    child_env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
        LAUNCHED_ENV: os.path.abspath(report_dir),
        LAUNCHED_AUDIT_ENV: "" if audit_every is None else str(audit_every),
        LAUNCHED_SANITIZE_ENV: "1" if sanitize else "",
        LAUNCHED_ON_CPU_ENV: str(on_cpu) if on_cpu else "",
        STALL_ENV: repr(stall_timeout_s),
    }
    with tree.subreaper():  # workers whose launcher died come to us, not to init
        start = time.monotonic()
        # The launcher's output as it is (one stream for all its ranks): on the console, on
        # stderr when stdout is for --json, nowhere when nothing is echoed.
        out = subprocess.DEVNULL if console is None else None if console is sys.stdout else 2
        launcher = subprocess.Popen(list(argv), env=child_env, stdout=out)
        watch = _Watch(os.path.abspath(report_dir), stall_timeout_s)
        try:
            reason = watch.run(launcher, start + timeout_s)
            result = watch.result(reason, time.monotonic() - start)
        finally:
            _write(report_dir, "job.diagnosed")  # a failing rank waits for it before its traceback
            # After an end or a crash the launcher ends its workers its own way (and reports a
            # failure as it would have); after a hang, the deadline or Ctrl-C, it is ended now.
            polite = watch.reason in ("end", "crash")
            if polite and launcher.poll() is None:
                _wait(launcher, END_WAIT_S)
            pids = list(watch.local.pids.values())
            marker = f"{LAUNCHED_ENV}={child_env[LAUNCHED_ENV]}".encode()
            tree.end_all(pids, launcher, GRACE_S if polite else 0.0, marker)
    if not watch.local.ranks:
        raise ValueError(
            f"nothing joined a process group: {' '.join(argv)} exited with code "
            f"{launcher.returncode} and none of its processes called init_process_group "
            "(the audit and the watchdog follow processes that do)"
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
        """Ranks that joined since the last look (a world size is known once one has)."""
        for r in range(max(self.world, 1)):
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
        if status.ended and len(self.local.ranks) >= self.world:
            if launcher_ended:
                return bool(self._set("end"))
            return False  # the launcher is still tearing down
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


def _wait(launcher: subprocess.Popen, seconds: float) -> None:
    try:
        launcher.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def _write(folder: str, name: str) -> None:
    with open(os.path.join(folder, name), "w"):
        pass
