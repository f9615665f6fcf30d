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
from dataclasses import dataclass
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
    spec = _Launch(
        fn=fn,
        args=args,
        world_size=world_size,
        timeout_s=timeout_s,
        backend=backend,
        device=gpus.device_for(device, backend),
        env=env,
        stall_timeout_s=stall_timeout_s,
        report_dir=report_dir,
        threads_per_rank=threads_per_rank,
        ranks_at_once=ranks_at_once,
        nccl_blocking_wait=nccl_blocking_wait,
    )
    if joining():
        return torchrun.join(
            fn, args, world_size, timeout_s, backend, env or {}, threads_per_rank, spec.device
        )
    return spec.spawn()


@dataclass(frozen=True, kw_only=True)
class _Launch:
    """`launch`'s arguments, checked: ValueError, one line, for one out of its range or a
    placement no machine runs or this one cannot (`gpus.check`); `device` resolved."""

    fn: Callable[..., Any]
    args: tuple
    world_size: int
    timeout_s: float
    backend: str
    device: str
    env: dict[str, str] | None
    stall_timeout_s: float | None
    report_dir: str | None
    threads_per_rank: int | None
    ranks_at_once: int | None
    nccl_blocking_wait: bool

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        gpus.check(self.device, self.backend)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 or None, got {self.stall_timeout_s}")

    def spawn(self) -> LaunchResult:
        """Start the ranks here and run them to the end: each with its share of the cores (and
        on cuda its GPU, given back at the end), meeting in a fresh temporary folder (removed
        at the end) that also holds their files unless `report_dir` does. ValueError: more
        NCCL ranks than GPUs, or `fn` or `args` that do not pickle."""
        n = self.world_size
        budget = thread_budget(self.ranks_at_once or n, self.threads_per_rank)
        visible = gpus.visible() if self.device == "cuda" else 0
        if self.backend == "nccl" and n > visible:
            raise ValueError(f"backend 'nccl' needs a CUDA device per rank: {n} > {visible}")
        try:
            payload = pickle.dumps((self.fn, self.args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ValueError(f"fn must be module-level and args picklable: {exc}") from exc
        tmpdir = tempfile.mkdtemp(prefix="ddp-verify-")
        keep = self.report_dir or tmpdir
        devices = (
            gpus.take(n, visible, shared=self.backend != "nccl") if self.device == "cuda" else []
        )
        jobs = self._jobs(payload, budget.per_rank, tmpdir, keep, devices)
        child_env = {SPAWNED_ENV: "1", **budget.env(), **(self.env or {})}
        # CUDA ranks start as fresh interpreters: a process forked from one is CUDA-safe only
        # while nothing initialized CUDA before the fork, which the zygote cannot promise.
        zygotes = Zygote.for_launch(self.env, n) if self.device == "cpu" else []
        if self.stall_timeout_s is not None:
            child_env[STALL_ENV] = repr(self.stall_timeout_s)
        try:
            return runner.run(
                jobs,
                folder=keep,
                env=child_env,
                timeout_s=self.timeout_s,
                clock_from_up=True,
                stall_timeout_s=self.stall_timeout_s,
                report_dir=self.report_dir,
                threads=budget.describe(),
                start=time.monotonic(),
                zygotes=zygotes,
            )
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
            gpus.give_back(devices)

    def _jobs(self, payload: bytes, threads: int, tmpdir: str, keep: str, devices: list[int]):
        """Each rank's job: `payload` (fn and args, pickled) run with `threads` threads, on
        its GPU of `devices` (when any), meeting the others in `tmpdir`, its files in `keep`."""
        main_file = None
        if getattr(self.fn, "__module__", None) == "__main__":
            main_file = getattr(sys.modules["__main__"], "__file__", None)
        traced = self.stall_timeout_s is not None
        return [
            RankJob(
                kind="fn",
                rank=r,
                world_size=self.world_size,
                local_rank=r,
                ppid=os.getpid(),
                threads=threads,
                stack_path=os.path.join(keep, f"rank{r}.stack"),
                trace_path=os.path.join(keep, f"rank{r}.trace") if traced else None,
                helper_dir=keep if traced or self.report_dir else None,
                backend=self.backend,
                device=self.device,
                payload=payload,
                sys_path=tuple(sys.path),
                main_file=main_file,
                init_method="file://" + os.path.join(tmpdir, "rendezvous"),
                pg_timeout_s=STARTUP_CAP_S + self.timeout_s + _PG_TIMEOUT_SLACK_S,
                nccl_blocking_wait=self.nccl_blocking_wait,
                device_index=devices[r] if devices else None,
            )
            for r in range(self.world_size)
        ]
