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

from verify.launching import loopback, private
from verify.launching.outcome import LaunchResult
from verify.launching.process import RankProcess, end_all
from verify.launching.rank_job import RankJob
from verify.launching.supervisor import (
    STARTUP_CAP_S,
    check_interrupted,
    interrupted,
    supervise,
)
from verify.watching import capture, spawned, trace_file
from verify.watching.diagnose import diagnose
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
    kept), and must be this user's alone (`private.check_dir`; else `private.Untrusted`); `env` is added to this process's environment for every rank; `stream`
    sends the ranks' output, prefixed, to that console as well as to their files (scripts);
    `zygotes[r]` forks rank r from a process that has imported torch (`zygote.py`).
    """
    check_interrupted()
    private.check_dir(folder)  # what the ranks leave there is read: this user's alone
    n = len(jobs)
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
    stack_paths = [job.stack_path for job in jobs]
    trace_paths = [job.trace_path for job in jobs]
    watchdog = None
    if stall_timeout_s is not None:
        watchdog = Watchdog(
            trace_paths,
            stall_timeout_s,
            where=capture.asker(folder, capture.read_where),
            in_torch=capture.asker(folder, capture.read_in_torch),
            own_ranks=lambda r: spawned.read(folder, r) is not None,
        )
    traces = None
    try:
        for rank in ranks:
            check_interrupted()
            rank.start(cancelled=interrupted)
        sup = supervise(
            ranks,
            timeout_s=timeout_s,
            clock_from_up=clock_from_up,
            stack_paths=stack_paths,
            watchdog=watchdog,
            report_dir=report_dir,
        )
        # Read before the ranks are ended: a rank that sees its peer die would record its
        # pending collective as failed. (A folder removed mid-run: the caller says so.)
        if os.path.lexists(folder):
            private.check_dir(folder)
        traces = [trace_file.read_trace(p) if p else None for p in trace_paths]
    finally:
        end_all(ranks, grace_s=0.0 if interrupted() else 0.5)  # interrupted: now, not politely
        for rank in ranks:
            rank.job_file.close()
    outcomes = []
    for o, rank in zip(sup.outcomes, ranks, strict=True):
        tail = None if o.status == "ok" else _tail(rank.err_path or rank.log_path)
        outcomes.append(replace(o, exitcode=rank.exitcode, stderr=tail, pid=rank.pid))
    diagnosis = None
    if watchdog is not None:
        diagnosis = diagnose(
            traces,
            outcomes,
            stalled=sup.stalled,
            stall_timeout_s=stall_timeout_s,
            detection_s=watchdog.detection_s() if (sup.failure_order or sup.stalled) else None,
            failure_order=sup.failure_order,
            timed_out=sup.timed_out,
            own_ranks=tuple(o for r in range(n) if (o := spawned.read(folder, r)) is not None),
        )
    return LaunchResult(
        world_size=n,
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
