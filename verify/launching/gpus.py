"""Which GPUs a launch's NCCL ranks use: spread over the visible ones, not piled on the first.

Rank r on `cuda:r` is right for one launch at a time, but launches in one process run side by
side (the matrix runs its world sizes at once, `hang --scenarios` runs `--jobs` scenarios):
with that rule they all crowd GPUs 0 and 1, and an 8-GPU machine uses two. So each launch
reserves, for its ranks, the GPUs the fewest ranks of this process are using (the lowest
index on a tie), distinct within the launch (NCCL refuses two ranks of one communicator on
one GPU), and gives them back when it ends. Launches of other processes are not seen: the
test suite runs its GPU tests one at a time (tests/conftest.py).
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_ranks_on: Counter[int] = Counter()  # GPU index -> ranks of this process's running launches


def take(world_size: int, visible: int) -> list[int]:
    """The GPU of each of `world_size` ranks (rank r: the r-th), least used first, among
    `visible` GPUs (`world_size <= visible`); hold them until `give_back`."""
    if not 0 < world_size <= visible:
        raise ValueError(f"{world_size} ranks need as many GPUs, {visible} visible")
    with _lock:
        chosen = sorted(range(visible), key=lambda g: (_ranks_on[g], g))[:world_size]
        _ranks_on.update(chosen)
    return chosen


def give_back(chosen: list[int]) -> None:
    """The launch that took `chosen` has ended."""
    with _lock:
        _ranks_on.subtract(chosen)
