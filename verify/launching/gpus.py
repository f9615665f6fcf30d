"""Where a launch's ranks run: which GPU each rank uses, and whether a placement can run here.

Two placements put ranks on GPUs:

- `--backend nccl` (`--device cuda` implied): one GPU per rank. NCCL refuses two ranks of one
  communicator on one GPU, so a launch needs as many visible GPUs as ranks.
- `--device cuda --backend gloo`: every rank's tensors on a GPU, gloo carrying them. Ranks may
  share a GPU, so every CUDA path (the sanitizer on autograd's device thread, the audit of
  CUDA tensors across ranks, CUDA streams in the traces, the watchdog with CUDA work in
  flight) runs at world size 2 or more where only one GPU exists: a laptop, a CI runner.

Rank r on `cuda:r` is right for one launch at a time, but launches in one process run side by
side (the matrix runs its world sizes at once, `hang --scenarios` runs `--jobs` scenarios):
with that rule they all crowd GPUs 0 and 1, and an 8-GPU machine uses two. So each launch
reserves, for its ranks, the GPUs the fewest ranks of this process are using (the lowest
index on a tie), distinct within an NCCL launch, and gives them back when it ends. Launches
of other processes are not seen: the test suite runs its GPU tests one at a time
(tests/conftest.py).
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_ranks_on: Counter[int] = Counter()  # GPU index -> ranks of this process's running launches

DEVICES = ("cpu", "cuda")


def visible() -> int:
    """The GPUs this process can use (0 on a machine without CUDA, or a CPU build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_for(device: str | None, backend: str) -> str:
    """The device kind of a launch: `device`, or the one `backend` implies (nccl: cuda)."""
    return device or ("cuda" if backend == "nccl" else "cpu")


def check(device: str, backend: str) -> None:
    """Raise ValueError, one line, for a placement no machine runs, or one this machine cannot:
    nccl on CPU tensors, or CUDA without a GPU. (How many GPUs NCCL needs is the caller's to
    check: it knows how many of its ranks run here.)"""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError(
            "--backend nccl carries CUDA tensors only: use --device cuda (or leave --device "
            "out), or --backend gloo for CPU ranks"
        )
    if device == "cuda" and backend != "nccl" and visible() == 0:
        raise ValueError(
            f"--device cuda --backend {backend} needs a GPU: none is visible here "
            "(torch.cuda.is_available() is False); leave --device out to run on CPU ranks"
        )


def take(world_size: int, visible: int, *, shared: bool = False) -> list[int]:
    """The GPU of each of `world_size` ranks (rank r: the r-th), least used first, among
    `visible` GPUs; hold them until `give_back`. Distinct GPUs (`world_size <= visible`)
    unless `shared` (gloo), where ranks beyond the GPUs share them, spread evenly."""
    if visible < 1 or (not shared and world_size > visible) or world_size < 1:
        raise ValueError(f"{world_size} ranks need as many GPUs, {visible} visible")
    with _lock:
        if shared:
            chosen = []
            for _ in range(world_size):  # each rank on the least used GPU so far
                gpu = min(range(visible), key=lambda g: (_ranks_on[g], g))
                _ranks_on[gpu] += 1
                chosen.append(gpu)
            return chosen
        chosen = sorted(range(visible), key=lambda g: (_ranks_on[g], g))[:world_size]
        _ranks_on.update(chosen)
    return chosen


def give_back(chosen: list[int]) -> None:
    """The launch that took `chosen` has ended."""
    with _lock:
        _ranks_on.subtract(chosen)
