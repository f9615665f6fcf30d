"""An in-process world for tests: N ranks as N threads of this process, each with a `Group`
(verify/replica_audit/group.py) whose collectives meet at a barrier. For the logic above the
collectives (the recorder's shares, the audit's comparison) without a launch; the real groups
(`WorldGroup`, the script audit's `SideGroup` over gloo) are tested by the runs that use them.

The group keeps the protocol's contract strictly, as gloo would: every rank calls the same
collective in the same order with a tensor of one shape and dtype; a rank that does not is
an `AssertionError` on every rank, where gloo would hang or fail. A rank that raises, or a
collective not met within `timeout_s`, ends every rank (the barrier is broken) and `run`
raises the first rank's exception.
"""

from __future__ import annotations

import threading

import torch


class _Meeting:
    """Where the ranks' threads exchange one value each per collective."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list = [None] * size

    def exchange(self, rank: int, what: str, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (a copy), in rank order, once every rank has called this."""
        self.slots[rank] = (what, t.detach().clone())
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # no rank overwrites its slot before every rank has read them
        kinds = {(w, x.dtype, tuple(x.shape)) for w, x in got}
        assert len(kinds) == 1, f"the ranks' collectives do not match: {sorted(map(str, kinds))}"
        return [x.clone() for _, x in got]


class ThreadGroup:
    """Rank `rank` of the world, as a `Group`; `ready()` as the script audit's `SideGroup`."""

    def __init__(self, meeting: _Meeting, rank: int, size: int) -> None:
        self._meeting, self.rank, self.size = meeting, rank, size

    def ready(self) -> bool:
        return True

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._meeting.exchange(self.rank, "max", values.cpu())).amax(0)

    def gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._meeting.exchange(self.rank, "gather", t.cpu())

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return self._meeting.exchange(self.rank, f"broadcast from {src}", t.cpu())[src]


def run(fn, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """`fn(group, *args)` on each of `world_size` threads, one rank each: their return values,
    in rank order (module docstring for a rank that raises or waits forever)."""
    meeting = _Meeting(world_size, timeout_s)
    values: list = [None] * world_size
    errors: list = [None] * world_size

    def rank(r: int) -> None:
        try:
            values[r] = fn(ThreadGroup(meeting, r, world_size), *args)
        except BaseException as exc:  # every rank's, the first raised below
            errors[r] = exc
            meeting.barrier.abort()

    threads = [
        threading.Thread(target=rank, args=(r,), name=f"rank {r}") for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not _broken(e)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return values


def _broken(exc: BaseException) -> bool:
    """A rank ended by another's failure (the barrier it waited at was broken)."""
    return isinstance(exc, threading.BrokenBarrierError)
