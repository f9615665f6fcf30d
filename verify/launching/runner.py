"""Start ranks from their jobs, supervise them, and turn what they left into a LaunchResult.

The path every spawned run takes, for a function (`spawn.launch`) and a user's script
(`script.run_script`) alike: hand each rank its job, start the ranks (`process.py`),
supervise them (`supervisor.py`), end and reap every one, then read what they left behind
(exit codes, the tails of their output, their collective traces) into one `RankOutcome` per
rank and the collective-trace diagnosis (`watching/diagnose.py`).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from dataclasses import replace
from typing import TextIO

from verify import private
from verify.launching import loopback
from verify.launching.outcome import LaunchResult
from verify.launching.process import RankProcess, end_all
from verify.launching.rank_job import RankJob
from verify.launching.supervisor import (
    STARTUP_CAP_S,
    Supervision,
    check_interrupted,
    interrupted,
    supervise,
)
from verify.watching import capture, spawned, trace_file
from verify.watching.diagnose import diagnose
from verify.watching.findings import Diagnosis
from verify.watching.watchdog import Watchdog

__all__ = ["STARTUP_CAP_S", "run"]
_TAIL_BYTES = 8192


def run(
    jobs: list[RankJob],
    *,
    folder: str,
    env: dict[str, str],
    timeout_s: float,
    clock_from_up: bool,
    stall_timeout_s: float | None,
    report_dir: str | None,
    threads: str,
    start: float,
    stream: TextIO | None = None,
    zygotes: list | None = None,
) -> LaunchResult:
    """Run `jobs` (one per rank) to the end; see the module docstring.

    `folder` holds the ranks' output, stacks and traces (the report folder when one is
    kept), and must be this user's alone (`private.check_dir`; else `private.Untrusted`);
    `env` is added to this process's environment for every rank; `stream` sends the ranks'
    output, prefixed, to that console as well as to their files (scripts); `zygotes[r]`
    forks rank r from a process that has imported torch (`zygote.py`).
    """
    check_interrupted()
    private.check_dir(folder)  # what the ranks leave there is read: this user's alone
    ranks = _rank_processes(jobs, folder, env, stream, zygotes)
    trace_paths = [job.trace_path for job in jobs]
    watchdog = _watchdog(trace_paths, stall_timeout_s, folder)
    sup, traces = _supervised(
        ranks,
        folder,
        trace_paths,
        timeout_s=timeout_s,
        clock_from_up=clock_from_up,
        stack_paths=[job.stack_path for job in jobs],
        watchdog=watchdog,
        report_dir=report_dir,
    )
    outcomes = []
    for o, rank in zip(sup.outcomes, ranks, strict=True):
        tail = None if o.status == "ok" else _tail(rank.err_path or rank.log_path)
        outcomes.append(replace(o, exitcode=rank.exitcode, stderr=tail, pid=rank.pid))
    diagnosis = None
    if watchdog is not None:
        diagnosis = _diagnosis(sup, traces, outcomes, watchdog, folder)
    return LaunchResult(
        world_size=len(jobs),
        outcomes=tuple(outcomes),
        elapsed_s=time.monotonic() - start,
        timed_out=sup.timed_out,
        failure_order=sup.failure_order,
        stalled=sup.stalled,
        diagnosis=diagnosis,
        notes=sup.notes,
        threads=threads,
        report_dir=report_dir,
    )


def _rank_processes(jobs, folder, env, stream, zygotes) -> list[RankProcess]:
    """One `RankProcess` a job, not started: its environment this process's with `env` and
    the job's RANK, LOCAL_RANK and WORLD_SIZE, its output to files in `folder`."""
    base = {**os.environ, **env}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        # Gloo listens on whatever the hostname resolves to, NCCL's bootstrap on the first
        # interface that is not loopback: our ranks are all local, so nothing they open need
        # be reachable from the network (a variable the user set wins).
        base.setdefault(name, loopback.ifname())
    ranks = []
    for job in jobs:
        rank_env = {
            **base,
            "RANK": str(job.rank),
            "LOCAL_RANK": str(job.local_rank),
            "WORLD_SIZE": str(job.world_size),
        }
        split = job.kind == "script"  # a script's stdout and stderr are kept apart
        ranks.append(
            RankProcess(
                job.rank,
                _job_file(job),
                rank_env,
                log_path=os.path.join(folder, f"rank{job.rank}.{'stdout' if split else 'stderr'}"),
                err_path=os.path.join(folder, f"rank{job.rank}.stderr") if split else None,
                stream=stream,
                zygote=zygotes[job.rank] if zygotes else None,
            )
        )
    return ranks


def _watchdog(trace_paths, stall_timeout_s: float | None, folder: str) -> Watchdog | None:
    """The hang watchdog over the ranks' traces, which asks the ranks (their helpers, through
    `folder`) where they are; None without a stall timeout (nothing traced)."""
    if stall_timeout_s is None:
        return None
    helpers = capture.helpers(folder)
    return Watchdog(
        trace_paths,
        stall_timeout_s,
        where=helpers.where,
        in_torch=helpers.in_torch,
        own_ranks=lambda r: spawned.read(folder, r) is not None,
    )


def _supervised(ranks, folder, trace_paths, **how) -> tuple[Supervision, list]:
    """Start `ranks`, supervise them (`how`: `supervise`'s keywords) and read their
    collective traces; then end and reap every rank, also when this raises (when
    interrupted, at once rather than politely)."""
    try:
        for rank in ranks:
            check_interrupted()
            rank.start(cancelled=interrupted)
        sup = supervise(ranks, **how)
        # Read before the ranks are ended: a rank that sees its peer die would record its
        # pending collective as failed. (A folder removed mid-run: the caller says so.)
        if os.path.lexists(folder):
            private.check_dir(folder)
        return sup, [trace_file.read_trace(p) if p else None for p in trace_paths]
    finally:
        end_all(ranks, grace_s=0.0 if interrupted() else 0.5)
        for rank in ranks:
            rank.job_file.close()


def _diagnosis(sup: Supervision, traces, outcomes, watchdog: Watchdog, folder: str) -> Diagnosis:
    """The collective traces' diagnosis of the run (`watching/diagnose.py`), with the ranks
    that started ranks of their own (`spawned.py`)."""
    return diagnose(
        traces,
        outcomes,
        stalled=sup.stalled,
        stall_timeout_s=watchdog.stall_timeout_s,
        detection_s=watchdog.detection_s() if (sup.failure_order or sup.stalled) else None,
        failure_order=sup.failure_order,
        timed_out=sup.timed_out,
        own_ranks=tuple(
            o for r in range(len(outcomes)) if (o := spawned.read(folder, r)) is not None
        ),
    )


def _job_file(job: RankJob):
    """An anonymous file (no name in any folder, so no other user can write or swap it)
    holding `job`, pickled: the rank inherits its descriptor (`rank.main`). A pickle is code,
    so it never comes from a file another principal can reach."""
    f = tempfile.TemporaryFile()  # noqa: SIM115 - closed once the rank is over
    pickle.dump(job, f, protocol=pickle.HIGHEST_PROTOCOL)
    f.flush()
    return f


def _tail(path: str) -> str | None:
    """The last few KB a rank wrote (None if nothing)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return text or None
