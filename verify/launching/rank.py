"""Inside a rank: what runs between the interpreter's start and the rank's exit.

`main(job_path, fd)` is the entry point of every rank the tool starts (`process.py` execs it).
The job file says what to run:

- a function (`kind="fn"`): join the process group through the launch's `file://` store,
  report "up", call `fn(ctx, *args)`, report its value or its traceback;
- a user's script (`kind="script"`): run it as `__main__` with its own argv, as `python
  script.py` would; the script calls `init_process_group` itself (its "up" is reported when
  that returns) and its exception or non-zero exit is its failure.

Either way, before any user code runs, the rank: dies with its parent (PR_SET_PDEATHSIG, so
a SIGKILLed tool leaves no rank behind), takes its thread budget, registers faulthandler on
SIGUSR1 and on fatal signals into its stack file (the parent asks for a dump at a hang),
traces its collectives into its trace file (`watching/tracer.py`) and starts the helper thread
that answers the parent's questions (where is the main thread now; the flight recorder's
dump), since a rank stuck in C++ cannot run a Python signal handler on its main thread.
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
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from verify.launching import process, threads
from verify.launching.outcome import RankContext, RankReport, Say, Up, one_line
from verify.script_audit.report import AuditSettings


@dataclass(frozen=True, kw_only=True)
class RankJob:
    """Everything a rank needs, written by the parent into a job file before the exec."""

    kind: str  # "fn" | "script"
    rank: int
    world_size: int
    local_rank: int
    ppid: int
    threads: int
    stack_path: str
    trace_path: str | None = None  # None: collectives are not traced
    helper_dir: str | None = None  # where the parent's requests and the answers go
    backend: str = "gloo"
    # kind "fn"
    payload: bytes = b""  # pickle of (fn, args)
    sys_path: tuple[str, ...] = ()
    main_file: str | None = None  # fn lives in the parent's __main__: this file
    init_method: str = ""
    pg_timeout_s: float = 1800.0
    # A traced rank on NCCL waits for its collectives to complete (`block_nccl_waits`); the
    # measurement commands turn this off, as it would change what they measure.
    nccl_blocking_wait: bool = True
    device_index: int | None = None  # NCCL: the rank's GPU (`gpus.py`); None: local_rank
    # kind "script"
    argv: tuple[str, ...] = field(default_factory=tuple)
    races_path: str | None = None  # run the script under the race sanitizer; findings here
    # called with the failure report before the traceback is printed (a torchrun job's node
    # watchdog puts the job's diagnosis first: `jobwide.rank_failed`); never pickled
    on_failure: Callable[[RankReport], None] | None = None
    audit: AuditSettings | None = None  # audit the script's replicas at its optimizer steps


def script_job(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    ppid: int,
    threads: int,
    report_dir: str,
    argv: tuple[str, ...],
    sanitize: bool = False,
    audit_every: int | None = None,
) -> RankJob:
    """The job of one rank of a user's script, its files in `report_dir` (the same for the
    tool's own launch, `script.py`, and a torchrun job's rank, `torchrun.script_main`): a
    traced rank with its stack and helper files, the race sanitizer when asked, the replica
    audit every `audit_every` optimizer steps when asked."""
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
        races_path=at("races.json") if sanitize else None,
        audit=None if audit_every is None else AuditSettings(audit_every, at("audit.json")),
    )


def main(job_path: str, fd: int, parent: int | None = None) -> None:
    """The entry point: `parent` is the process this rank must die with, when it is not the
    tool itself (a rank forked by the zygote dies with the zygote, which dies with the tool)."""
    with open(job_path, "rb") as f:
        job: RankJob = pickle.load(f)
    if parent is not None:
        job = replace(job, ppid=parent)
    run_job(job, fd)


_report_fd: int | None = None


def say(text: str) -> None:
    """In a rank: a progress line for the parent to print (see `verify/progress.py`)."""
    process.send(_report_fd, Say(text))


def run_job(job: RankJob, fd: int | None) -> None:
    """Set the rank up and run its job; reports go to `fd` (None: nobody listens)."""
    global _report_fd
    _report_fd = fd
    _die_with_parent(job.ppid)
    _enable_faulthandler(job.stack_path)
    threads.apply(job.threads)
    if job.kind == "fn":
        _run_fn(job, fd)
    else:
        _run_script(job, fd)


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
        if job.backend == "nccl":
            gpu = job.local_rank if job.device_index is None else job.device_index
            device = torch.device("cuda", gpu)
            torch.cuda.set_device(device)
        _start_helper(job)
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
    """Run fn: its pickled value, or an error report (unpicklable values included)."""
    try:
        return RankReport("ok", pickle.dumps(fn(ctx, *args), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures of fn too
        return error_report(exc)


def error_report(exc: BaseException) -> RankReport:
    """The report of a raise: what fn had found before it failed travels in `value`, when it
    attached it to the exception (`exc.partial`)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    partial = None
    if getattr(exc, "partial", None) is not None:
        with contextlib.suppress(Exception):
            partial = pickle.dumps(exc.partial, protocol=pickle.HIGHEST_PROTOCOL)
    return RankReport("error", partial, one_line(exc), tb, time.time())


# ------------------------------------------------------------ a user's script


_SCRIPT_OK = RankReport("ok", pickle.dumps(None))  # a script returns nothing


def _run_script(job: RankJob, fd: int | None) -> None:
    import torch.distributed as dist

    path, *args = job.argv
    sys.argv = [path, *args]
    # As `python script.py` does: the script's directory first, not this tool's.
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    if job.trace_path is not None:  # before the script imports anything from torch.distributed
        from verify.watching import tracer

        tracer.install(job.trace_path, rank=job.rank)
    _report_up_after_init(dist, fd, job)
    _start_helper(job)
    sanitizer = _sanitize(job)
    auditor = _audit(job)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code in (None, 0):
            process.send(fd, _SCRIPT_OK)
        else:
            why = f"exited with code {exc.code}" if isinstance(exc.code, int) else str(exc.code)
            process.send(fd, RankReport.failure(why))
        raise
    except BaseException as exc:
        report = error_report(exc)
        process.send(fd, report)
        if job.on_failure is not None:
            job.on_failure(report)
        traceback.print_exc()  # what `python script.py` would show, on the rank's stderr
        sys.stderr.flush()
        _finish_audit(auditor)  # what it found before the crash (os._exit skips `finally`)
        os._exit(1)
    finally:
        _save_races(sanitizer, job)
        _finish_audit(auditor)
    process.send(fd, _SCRIPT_OK)


def _sanitize(job: RankJob):
    """The race sanitizer around a user's script (`hang --nproc N --sanitize`): a script has
    no steps the tool knows of, so works never waited on are found when it ends."""
    if job.races_path is None:
        return None
    from verify.sanitize import Sanitizer

    sanitizer = Sanitizer(rank=job.rank)
    sanitizer.install()
    return sanitizer


def _save_races(sanitizer, job: RankJob) -> None:
    if sanitizer is None:
        return
    import json

    with contextlib.suppress(Exception):
        sanitizer.end_step()
        with open(job.races_path, "w") as f:
            json.dump([r.to_dict() for r in sanitizer.findings], f, indent=1, default=str)


def _audit(job: RankJob):
    """The replica audit at every optimizer step (`audit --nproc N`, `verify/script_audit/`),
    installed before the script builds its first module."""
    if job.audit is None:
        return None
    from verify.script_audit import Auditor

    auditor = Auditor(job.audit)
    auditor.install()
    return auditor


def _finish_audit(auditor) -> None:
    if auditor is not None:
        with contextlib.suppress(Exception):
            auditor.finish()


def _report_up_after_init(dist, fd: int | None, job: RankJob) -> None:
    """Report "up" once the script's `init_process_group` returns (the rank has met its
    peers): until then it is starting, not hung. A traced script's NCCL waits block
    (`block_nccl_waits`), decided from the backend it asks for."""
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if job.trace_path is not None and job.nccl_blocking_wait:
            block_nccl_waits(kwargs.get("backend", args[0] if args else None))
        out = original(*args, **kwargs)
        process.send(fd, Up())
        return out

    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group


# ------------------------------------------------------------ common set-up

BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"


def block_nccl_waits(backend) -> None:
    """Before a traced rank makes a process group that uses NCCL: make NCCL's `wait()` block
    the CPU until the collective has completed (it polls, sleeping), unless the user chose.

    The tracer marks a blocking collective complete when the call returns, and an async one
    when `wait()` returns. On NCCL both return once the collective is queued on the GPU, so
    a rank behind a collective that never completes would run on, its trace saying it waits
    in nothing, and spin at 100% CPU in the next host sync (`.item()`): the watchdog would
    see it computing, and call no hang until the deadline. With blocking waits it sits in
    that collective's `wait()`, idle, as a gloo rank does. gloo never reads the variable: a
    CPU run is unchanged. `backend`: what `init_process_group` is given (None: its default,
    NCCL for CUDA tensors when there is a GPU)."""
    import torch

    name = str(backend or "").lower()
    if "nccl" in name or (backend is None and torch.cuda.is_available()):
        os.environ.setdefault(BLOCKING_WAIT_ENV, "1")


def group_kwargs(backend: str, device) -> dict:
    """What `init_process_group` gets besides the rendezvous: on NCCL the rank's GPU
    (`device_id`), so that the communicator is made inside `init_process_group`, before the
    rank reports "up" (eager init), and not inside its first traced collective, where its set-up
    (seconds with 8 GPUs and NCCL_DEBUG=INFO) would count against the stall timeout."""
    return {"device_id": device} if backend == "nccl" else {}


def _die_with_parent(ppid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != ppid:  # the parent died before prctl took effect
        os._exit(1)


def _enable_faulthandler(stack_path: str) -> None:
    stack_file = open(stack_path + ".tmp", "w")  # noqa: SIM115 - faulthandler keeps it open
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=stack_file, all_threads=True)  # fatal signals dump there too
    os.replace(stack_path + ".tmp", stack_path)  # from now on the parent may send SIGUSR1


def _start_helper(job: RankJob) -> None:
    if job.helper_dir is not None:
        from verify.watching import capture

        capture.start_rank_helper(job.helper_dir, job.rank)
