"""Inside a rank of a user's script (`hang --nproc N -- train.py`, `audit --nproc N`, a
torchrun job's rank under `verify.hang_run`): the script runs as `__main__` with its own argv,
as `python script.py` would, after the rank's common set-up (`rank.run_job`).

The script calls `init_process_group` itself: its "up" is reported when that returns (until
then the rank is starting, not hung). Its exception or non-zero exit is its failure, reported
before the traceback is printed. Its collectives are traced from before it imports anything;
under `--sanitize` the race sanitizer runs around it, under `audit` the replica audit at every
optimizer step, under `--on-cpu` the rehearsal on the CPU (the job's set-ups, `setups.py`,
named by the front end); what they found is saved even when the script crashes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import runpy
import sys
import traceback

from verify.launching import needs_cuda, process, setups
from verify.launching.outcome import Failing, RankReport, Up
from verify.launching.rank_job import RankJob, block_nccl_waits, error_report, start_helper
from verify.launching.setups import SetUp


def script_job(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    ppid: int,
    threads: int,
    report_dir: str,
    argv: tuple[str, ...],
    setups: tuple[SetUp, ...] = (),
) -> RankJob:
    """The job of one rank of a user's script, its files in `report_dir` (the same for the
    tool's own launch, `script.py`, a torchrun job's rank, `torchrun.script_main`, and a
    launcher command's, `launched.py`): a traced rank with its stack and helper files, and
    the `setups` the front end asked for, in order (`setups.py`; theirs go to `report_dir`
    too)."""
    at = lambda name: os.path.join(report_dir, f"rank{rank}.{name}")  # noqa: E731
    return RankJob(
        kind="script",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        ppid=ppid,
        threads=threads,
        stack_path=at("stack"),
        trace_path=at("trace"),
        helper_dir=report_dir,
        argv=tuple(argv),
        setups=tuple(setups),
    )


_SCRIPT_OK = RankReport("ok", pickle.dumps(None))  # a script returns nothing
_ASKED: dict = {}  # what the script passed init_process_group (its "backend")


def run_script_job(job: RankJob, fd: int | None) -> None:
    import torch
    import torch.distributed as dist

    # A fresh interpreter seeds torch's CPU generator from the OS, so a script that seeds
    # nothing draws differently on each rank (a bug the audit must see); a rank forked from
    # its zygote would otherwise draw what the zygote's seed gives, at every launch.
    torch.default_generator.seed()
    path, *args = job.argv
    sys.argv = [path, *args]
    # As `python script.py` does: the script's directory first, not this tool's.
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    if job.helper_dir is not None:  # ranks the script starts itself are not watched: say so
        from verify.watching import spawned

        spawned.install(job.helper_dir, job.rank)
    _report_up_after_init(dist, fd, job)
    running = watch_and_set_up(job)  # before the script imports from torch.distributed
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code in (None, 0):
            process.send(fd, _SCRIPT_OK)
        else:
            _failing(job, fd)
            setups.finish(running, exc)  # a failure, as under a launcher (`launched.py`)
            why = f"exited with code {exc.code}" if isinstance(exc.code, int) else str(exc.code)
            process.send(fd, RankReport.failure(why))
        raise
    except BaseException as exc:
        _failing(job, fd)  # at once: saving and formatting below take a while
        # What the set-ups found, saved before the report (os._exit skips `finally`); a call
        # the rehearsal could not map is a usage error: no verdict, exit 2
        needs = setups.finish(running, exc)
        if needs is None and not setups.reads_failures(running):
            needs = needs_cuda.classify(exc, _ASKED.get("backend"))
        # a usage error (needs is not None), said once by the parent (needs_cuda.py)
        report = error_report(exc, needs)
        process.send(fd, report)
        if job.on_failure is not None:
            job.on_failure(report)
        _print_traceback(job, quiet=needs is not None)
        os._exit(1)
    finally:
        setups.finish(running)  # (a second finish does nothing)
    process.send(fd, _SCRIPT_OK)


def _failing(job: RankJob, fd: int | None) -> None:
    """Tell whoever watches this rank that it raised and a failure report follows."""
    process.send(fd, Failing())
    if job.on_failing is not None:
        job.on_failing()


def watch_and_set_up(job: RankJob) -> list:
    """What every rank of a user's script gets, however it was started (the tool's own
    launch, a torchrun job's rank, a rank a launcher command started: `launched.py`): its
    collectives traced, the helper thread that answers the watchdog, and the job's set-ups
    (`setups.py`: the race sanitizer, the replica audit, the rehearsal on the CPU). Returns
    them running; `setups.finish` saves what they found."""
    if job.trace_path is not None:
        from verify.watching import tracer

        tracer.install(job.trace_path, rank=job.rank)
    start_helper(job)
    return setups.start(job.setups, job.rank, job.helper_dir)


def _print_traceback(job: RankJob, quiet: bool) -> None:
    """What `python script.py` would show, on the rank's stderr; `quiet`: in its stderr file
    only (the parent says in one line what every rank would have repeated)."""
    path = os.path.join(job.helper_dir, f"rank{job.rank}.stderr") if job.helper_dir else None
    if quiet and path is not None and os.path.exists(path):  # (our own launch pumps to it)
        with contextlib.suppress(OSError), open(path, "a") as f:
            traceback.print_exc(file=f)
            return
    traceback.print_exc()
    sys.stderr.flush()


def _report_up_after_init(dist, fd: int | None, job: RankJob) -> None:
    """Report "up" once the script's `init_process_group` returns (the rank has met its
    peers): until then it is starting, not hung. A traced script's NCCL waits block
    (`block_nccl_waits`), decided from the backend it asks for."""
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        _ASKED["backend"] = backend
        if str(backend).lower() == "nccl" and not dist.is_nccl_available():
            # torch's own error, without the warning it prints first on every rank
            raise RuntimeError("Distributed package doesn't have NCCL built in")
        if job.trace_path is not None and job.nccl_blocking_wait:
            block_nccl_waits(backend)
        out = original(*args, **kwargs)
        process.send(fd, Up())
        if job.on_up is not None:
            job.on_up()
        return out

    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group
