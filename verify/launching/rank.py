"""Inside a rank: what runs between the interpreter's start and the rank's exit.

`main(job_fd, fd)` is the entry point of every rank the tool starts (`process.py` execs it).
The job, read from the anonymous file `job_fd` the rank inherits, says what to run:

- a function (`kind="fn"`): join the process group through the launch's `file://` store,
  report "up", call `fn(ctx, *args)`, report its value or its traceback;
- a user's script (`kind="script"`): run it as `__main__` with its own argv, as `python
  script.py` would; the script calls `init_process_group` itself (its "up" is reported when
  that returns) and its exception or non-zero exit is its failure (`rank_script.py`).

Either way, before any user code runs, the rank: dies with its parent (PR_SET_PDEATHSIG, so
a SIGKILLed tool leaves no rank behind), takes its thread budget, registers faulthandler on
SIGUSR1 and on fatal signals into its stack file (the parent asks for a dump at a hang),
traces its collectives into its trace file (`watching/tracer.py`) and starts the helper thread
that answers the parent's questions (where is the main thread now; the flight recorder's
dump), since a rank stuck in C++ cannot run a Python signal handler on its main thread.
What the job holds, and the pieces both kinds of rank use, are in `rank_job.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import os
import pickle
import runpy
import signal
import sys
from dataclasses import replace

from verify import private, progress
from verify.launching import process, threads
from verify.launching.outcome import Raised, RankContext, RankReport, Say, Up
from verify.launching.rank_job import (
    RankJob,
    block_nccl_waits,
    error_report,
    group_kwargs,
    start_helper,
)
from verify.launching.rank_script import run_script_job


def main(job_fd: int, fd: int, parent: int | None = None) -> str:
    """The entry point: `parent` is the process this rank must die with, when it is not the
    tool itself (a rank forked by the zygote dies with the zygote, which dies with the tool).
    Returns the job's kind, "fn" or "script" (how a forked rank ends: `zygote_serve.py`)."""
    # Ctrl-C raises KeyboardInterrupt, as in an interpreter started from a terminal, whatever
    # the tool or the zygote inherited: a tool started in the background (`cmd &` in a script,
    # nohup) has SIGINT ignored, which a fresh rank would inherit, and a script can tell
    # (tests/fixtures/rank_probe.py). Here, for fresh and forked ranks alike.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Read whole from its start, whatever the file's offset (one description, shared with
    # the tool and with any copy the zygote was sent), then closed.
    job: RankJob = pickle.loads(os.pread(job_fd, os.fstat(job_fd).st_size, 0))
    os.close(job_fd)
    if parent is not None:
        job = replace(job, ppid=parent)
    run_job(job, fd)
    return job.kind


def run_job(job: RankJob, fd: int | None) -> None:
    """Set the rank up and run its job; reports go to `fd` (None: nobody listens)."""
    if fd is not None:  # the parent prints this rank's progress lines
        progress.forward_to(lambda *line: process.send(fd, Say(*line)))
    _die_with_parent(job.ppid)
    _enable_faulthandler(job.stack_path)
    threads.apply(job.threads)
    if job.kind == "fn":
        _run_fn(job, fd)
    else:
        run_script_job(job, fd)


# ------------------------------------------------------------ a function


def _run_fn(job: RankJob, fd: int | None) -> None:
    import torch
    import torch.distributed as dist

    try:
        sys.path[:] = list(dict.fromkeys([*job.sys_path, *sys.path]))
        if job.main_file:  # as multiprocessing does for functions defined in __main__
            main_module = runpy.run_path(job.main_file, run_name="__mp_main__")
            module = type(sys)("__mp_main__")
            module.__dict__.update(main_module)
            sys.modules["__main__"] = sys.modules["__mp_main__"] = module
        fn, args = pickle.loads(job.payload)
        device = torch.device("cpu")
        if job.device == "cuda":
            gpu = job.local_rank if job.device_index is None else job.device_index
            device = torch.device("cuda", gpu)
            torch.cuda.set_device(device)
        start_helper(job)
        if job.trace_path is not None and job.nccl_blocking_wait:
            block_nccl_waits(job.backend)
        timeout = datetime.timedelta(seconds=job.pg_timeout_s)
        dist.init_process_group(
            job.backend,
            init_method=job.init_method,
            rank=job.rank,
            world_size=job.world_size,
            timeout=timeout,
            **group_kwargs(job.backend, device),
        )
        if job.backend == "gloo":
            # gloo connects every pair inside init_process_group, and a rank may leave it with
            # its side of each pair done while a slower peer is still connecting: a function
            # that then issued no collective and returned closed pairs that peer was reading
            # ("Gloo connectFullMesh failed ... Connection closed by peer", once under load).
            # The group is whole once every rank is past it. Untraced: the tool's own (the
            # flight recorder has it, first: docs/debugging.md).
            dist.barrier()
        if job.trace_path is not None:
            from verify.watching import tracer

            tracer.install(job.trace_path, rank=job.rank)
        process.send(fd, Up())  # starts the parent's clock for fn
        ctx = RankContext(
            job.rank, job.world_size, job.local_rank, device, job.backend, True, job.threads
        )
        report = call(fn, ctx, args)
    except BaseException as exc:  # fn's module failed to import here, the group to form
        report = error_report(exc)
    process.send(fd, report)  # before leaving: a failure reaches the parent before peers see us go
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def call(fn, ctx: RankContext, args: tuple) -> RankReport:
    """Run fn: its pickled value, or an error report (unpicklable values included; a returned
    `Raised` is its exception's report, with what fn had found)."""
    try:
        value = fn(ctx, *args)
        if isinstance(value, Raised):
            return error_report(value.exc, value.found)
        return RankReport("ok", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures of fn too
        return error_report(exc)


# ------------------------------------------------------------ common set-up


def adopt(job: RankJob) -> list:
    """Give a process a launcher started, which has just joined its process group, the set-up
    of a rank of the tool's (`launched.py`): its stack file and the script rank's watching
    and set-ups (`rank_script.watch_and_set_up`). Not what the launcher decides: its parent
    (it dies with its launcher, not with the tool) and its threads. Returns the set-ups
    running."""
    from verify.launching.rank_script import watch_and_set_up

    _enable_faulthandler(job.stack_path)
    return watch_and_set_up(job)


def _die_with_parent(ppid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != ppid:  # the parent died before prctl took effect
        os._exit(1)


def _enable_faulthandler(stack_path: str) -> None:
    stack_file = os.fdopen(private.create(stack_path + ".tmp"), "w")  # faulthandler keeps it
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=stack_file, all_threads=True)  # fatal signals dump there too
    os.replace(stack_path + ".tmp", stack_path)  # from now on the parent may send SIGUSR1
