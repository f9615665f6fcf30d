"""The thread budget: how many intra-op threads each rank the tool starts may use.

torch gives every process as many intra-op threads as the machine has cores. N ranks on one
machine then run N x cores threads that fight for the cores (16 pytest workers x 4 ranks x 16
threads is 1,000 threads on 16 cores: a load average near 100, and ranks so slow that correct
runs were diagnosed as crashes). As torchrun does, each rank gets its share instead:

    threads per rank = max(1, cores // (ranks running at once x jobs sharing the machine))

- cores: the CPUs this process may run on (`sched_getaffinity`, so a taskset or a container's
  cpuset is respected);
- ranks running at once: the launch's world size, or more when the caller runs several
  launches side by side (the certification matrix runs every world size at once);
- jobs sharing the machine: `DDP_VERIFY_JOBS` (the test suite sets it to the number of pytest
  workers), else 1.

An explicit request (`--threads-per-rank`) wins; an `OMP_NUM_THREADS` already set in the
environment wins over the computed share (the user, or torchrun, decided).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from verify.launching.env import JOBS_ENV


@dataclass(frozen=True)
class ThreadBudget:
    per_rank: int
    why: str  # how it was decided, for the report's machine line

    def describe(self) -> str:
        """`1 thread per rank (2 cores / 2 ranks)`."""
        plural = "s" if self.per_rank != 1 else ""
        return f"{self.per_rank} thread{plural} per rank ({self.why})"

    def env(self) -> dict[str, str]:
        """What a rank's environment needs so OpenMP and MKL start with this many threads."""
        return {"OMP_NUM_THREADS": str(self.per_rank), "MKL_NUM_THREADS": str(self.per_rank)}


def cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_budget(ranks_at_once: int, requested: int | None = None) -> ThreadBudget:
    """Each rank's share of the machine; see the module docstring for the rule."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads per rank must be >= 1, got {requested}")
        return ThreadBudget(requested, "--threads-per-rank")
    preset = os.environ.get("OMP_NUM_THREADS", "").strip()
    if preset.isdigit() and int(preset) >= 1:
        return ThreadBudget(int(preset), "OMP_NUM_THREADS")
    jobs = os.environ.get(JOBS_ENV, "").strip()
    jobs_n = int(jobs) if jobs.isdigit() and int(jobs) >= 1 else 1
    n = cores()
    ranks = max(1, ranks_at_once)
    why = f"{n} core{'s' if n != 1 else ''} / {ranks} rank{'s' if ranks != 1 else ''}"
    if jobs_n > 1:
        why += f" / {jobs_n} jobs"
    return ThreadBudget(max(1, n // (ranks * jobs_n)), why)


def apply(per_rank: int) -> None:
    """In a rank: set torch's intra-op threads (OpenMP reads the environment at start)."""
    import torch

    if torch.get_num_threads() != per_rank:
        torch.set_num_threads(per_rank)
