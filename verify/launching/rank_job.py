"""What a rank is given, and what both kinds of rank (a function's, `rank.py`; a user's
script's, `rank_script.py`) use inside it: the job's contents (`RankJob`), the report of
a raise, NCCL's blocking waits, the process group's keywords and the helper thread that
answers the parent's questions.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from verify.launching.outcome import RankReport, one_line


@dataclass(frozen=True, kw_only=True)
class RankJob:
    """Everything a rank needs, handed over by the parent before the exec (`runner._job_file`)."""

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
    device: str = "cpu"  # kind "fn": where its tensors live (`ctx.device`): cpu or cuda
    # kind "fn"
    payload: bytes = b""  # pickle of (fn, args)
    sys_path: tuple[str, ...] = ()
    main_file: str | None = None  # fn lives in the parent's __main__: this file
    init_method: str = ""
    pg_timeout_s: float = 1800.0
    # A traced rank on NCCL waits for its collectives to complete (`block_nccl_waits`); the
    # measurement commands turn this off, as it would change what they measure.
    nccl_blocking_wait: bool = True
    device_index: int | None = None  # cuda: the rank's GPU (`gpus.py`); None: local_rank
    # kind "script"
    argv: tuple[str, ...] = field(default_factory=tuple)
    # what runs around the script, in order: the plug-ins' set-ups the front end named
    # (`setups.SetUp`, `verify/plugins.py`), made in the rank
    setups: tuple = ()
    # called with the failure report before the traceback is printed (a torchrun job's node
    # watchdog puts the job's diagnosis first: `jobwide.rank_failed`); never pickled
    on_failure: Callable[[RankReport], None] | None = None
    # called once the script's init_process_group returned (a torchrun job's rank tells its
    # node watchdog it is up: `node_ranks.rank_up`); never pickled
    on_up: Callable[[], None] | None = None
    # called as soon as the script raised, before its set-ups save what they found and its
    # report is formatted (a torchrun job's node watchdog waits for it rather than calling
    # the job hung: `node_ranks.rank_failing`); never pickled
    on_failing: Callable[[], None] | None = None


def error_report(exc: BaseException, found: object = None) -> RankReport:
    """The report of a raise; `found`, when given, is what the rank had found before it
    failed (`outcome.Raised`), sent pickled in `value`."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    partial = None
    if found is not None:
        with contextlib.suppress(Exception):
            partial = pickle.dumps(found, protocol=pickle.HIGHEST_PROTOCOL)
    raised = {"exception": type(exc).__name__, **getattr(exc, "ddp_verify", {})}
    return RankReport("error", partial, one_line(exc), tb, time.time(), raised)


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


def start_helper(job: RankJob) -> None:
    if job.helper_dir is not None:
        from verify.watching import capture

        capture.start_rank_helper(job.helper_dir, job.rank)
