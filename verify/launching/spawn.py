"""`launch(fn, world_size=N)`: run a function on N ranks, the way every check runs.

`launch` runs `fn(ctx, *args)` in N ranks with an initialized process group and returns a
`LaunchResult` with one `RankOutcome` per rank. The guarantees:

- Each rank is a process of its own, world size 1 included (`process.py`): forked from a
  zygote that has imported torch and nothing else (`zygote.py`: milliseconds instead of the
  seconds an import costs), or a fresh interpreter where a zygote cannot serve (CUDA).
  They meet at a `file://` store in a fresh temp dir, so any number of launches
  (`pytest -n auto`, threads) can run at once: there is no port to collide on.
- Each rank takes its thread budget (`threads.py`): the machine's cores shared among the
  ranks running at once, as torchrun does.
- Each rank sends back its return value (pickled, returned exactly) or its formatted
  traceback. Failures come back as data, never as an exception out of `launch`. A returned
  `Raised` (`outcome.py`) is a failure: its exception's traceback, and what fn had found
  before it as the outcome's value.
- The supervisor (`supervisor.py`) ends the run at the first failure (after a short grace),
  at the deadline, or at the watchdog's hang verdict; every rank's collectives are traced and
  the watchdog calls a hang on evidence (`watching/watchdog.py`), with a diagnosis naming the
  rank, the collective and the call site (`watching/diagnose.py`). Collectives that completed
  but disagreed (SUM vs MAX) come back as a "desync" diagnosis.
- No process is left behind: every rank is ended and reaped before `launch` returns, also on
  Ctrl-C, and each rank dies with its parent even if the parent is SIGKILLed.

Under `torchrun` (RANK, WORLD_SIZE and MASTER_ADDR set) nothing is spawned: this process is
one rank of the job (`torchrun.py`).

fn must be a module-level (picklable) function, and it must call collectives in the same
order on all ranks, or it hangs until the stall timeout (and is diagnosed).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from verify.launching import gpus, runner, torchrun
from verify.launching.env import (
    DEFAULT_STALL_TIMEOUT_S,
    SPAWNED_ENV,
    STALL_ENV,
    joining,
)
from verify.launching.outcome import LaunchResult
from verify.launching.rank_job import RankJob
from verify.launching.supervisor import STARTUP_CAP_S
from verify.launching.threads import thread_budget
from verify.launching.zygote import Zygote

# The parent's deadline must come first, so a hang yields stacks rather than a gloo error.
_PG_TIMEOUT_SLACK_S = 10.0


def launch(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
    device: str | None = None,
    env: dict[str, str] | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    report_dir: str | None = None,
    threads_per_rank: int | None = None,
    ranks_at_once: int | None = None,
    nccl_blocking_wait: bool = True,
) -> LaunchResult:
    """Run `fn(ctx, *args)` on `world_size` ranks; the module docstring has the contract.

    Args:
        fn: module-level function `fn(ctx: RankContext, *args)`; its return value must pickle.
        world_size: number of ranks (must equal WORLD_SIZE when joining torchrun).
        args: extra positional arguments for fn, pickled to every rank.
        timeout_s: how long fn may run once every rank is up (starting comes on top).
        backend: "gloo" or "nccl" (one GPU per rank, the least used ones: `gpus.py`).
        device: where the ranks' tensors live (`ctx.device`): "cpu", or "cuda" (with gloo,
            ranks share the GPUs: `gpus.py`); None: cuda for nccl, else cpu.
        env: extra environment variables for the ranks, set before their interpreter starts.
        stall_timeout_s: seconds without collective progress (while a rank waits and none
            works) that make a hang; None turns tracing and the watchdog off.
        report_dir: keep every rank's output, stack dump and collective trace in this
            (existing) directory, and ask the ranks for the flight recorder's dump at a hang.
        threads_per_rank: intra-op threads per rank; None: the machine's share (`threads.py`).
        ranks_at_once: ranks this process runs at the same time over all its launches (the
            share is computed over them); default `world_size`.
        nccl_blocking_wait: on NCCL, traced ranks wait for each collective to complete, so
            that a hang is seen as one (`rank.block_nccl_waits`); False for measurements,
            whose timings it would change (a hang there ends at the deadline instead).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    device = gpus.device_for(device, backend)
    gpus.check(device, backend)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0 or None, got {stall_timeout_s}")
    if joining():
        return torchrun.join(
            fn, args, world_size, timeout_s, backend, env or {}, threads_per_rank, device
        )
    budget = thread_budget(ranks_at_once or world_size, threads_per_rank)
    visible = gpus.visible() if device == "cuda" else 0
    if backend == "nccl" and world_size > visible:
        raise ValueError(f"backend 'nccl' needs a CUDA device per rank: {world_size} > {visible}")
    try:
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(f"fn must be module-level and args picklable: {exc}") from exc
    main_file = None
    if getattr(fn, "__module__", None) == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
    tmpdir = tempfile.mkdtemp(prefix="ddp-verify-")
    keep = report_dir or tmpdir
    pg_timeout = STARTUP_CAP_S + timeout_s + _PG_TIMEOUT_SLACK_S
    devices = gpus.take(world_size, visible, shared=backend != "nccl") if device == "cuda" else []
    jobs = [
        RankJob(
            kind="fn",
            rank=r,
            world_size=world_size,
            local_rank=r,
            ppid=os.getpid(),
            threads=budget.per_rank,
            stack_path=os.path.join(keep, f"rank{r}.stack"),
            trace_path=os.path.join(keep, f"rank{r}.trace") if stall_timeout_s else None,
            helper_dir=keep if stall_timeout_s or report_dir else None,
            backend=backend,
            device=device,
            payload=payload,
            sys_path=tuple(sys.path),
            main_file=main_file,
            init_method="file://" + os.path.join(tmpdir, "rendezvous"),
            pg_timeout_s=pg_timeout,
            nccl_blocking_wait=nccl_blocking_wait,
            device_index=devices[r] if devices else None,
        )
        for r in range(world_size)
    ]
    child_env = {SPAWNED_ENV: "1", **budget.env(), **(env or {})}
    # CUDA ranks start as fresh interpreters: a process forked from one is CUDA-safe only
    # while nothing initialized CUDA before the fork, which the zygote cannot promise.
    zygotes = Zygote.for_launch(env, world_size) if device == "cpu" else []
    if stall_timeout_s is not None:
        child_env[STALL_ENV] = repr(stall_timeout_s)
    try:
        return runner.run(
            jobs,
            folder=keep,
            env=child_env,
            timeout_s=timeout_s,
            clock_from_up=True,
            stall_timeout_s=stall_timeout_s,
            report_dir=report_dir,
            threads=budget.describe(),
            start=time.monotonic(),
            zygotes=zygotes,
        )
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        gpus.give_back(devices)
