"""The one agreement reduction of the replica audit, over a small group interface.

Every audit (a class's replicas, the matrix's cells, the shard-layout check, a script's
replicas) decides whether the ranks agree the same way: each value's minimum and maximum over
the ranks, in one MAX all-reduce of `[x, ~x]` (`~x` = -x - 1 reverses the order without
overflowing, so max(~x) is ~min(x)). Equal minimum and maximum mean every rank holds the same
value. Its size is twice the number of values, whatever the world size: agreement stays O(1)
in the number of ranks, and per-rank detail is gathered only after a mismatch (`who_differs`:
every rank's values of the rows that disagree, the reference rank and the ranks that differ).

A group is anything with `rank`, `size`, `all_reduce_max` and `gather_tensor`: `WorldGroup` wraps a
`torch.distributed` process group (the class checks' world group, or the matrix's own gloo
group); the script audit's `SideGroup` (`verify/script_audit/side_group.py`) is another.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from verify.replica_audit.measure import reference_rank


class Group(Protocol):
    """The ranks an audit compares. `all_reduce_max` is a collective: every rank calls it in
    the same order with a tensor of the same size (sizes come from agreed values, never from
    rank-local shapes), or the job hangs."""

    rank: int
    size: int

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum over the ranks of an int64 tensor, on the CPU (`values`
        may be overwritten)."""
        ...

    def gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (a CPU tensor of one shape and dtype on every rank), on the CPU,
        in rank order."""
        ...


class WorldGroup:
    """A `torch.distributed` process group (None: the default group) as a `Group`."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.process_group)
        self.size = dist.get_world_size(self.process_group)

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        t = values.to(comm_device(self.process_group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return t.cpu()

    def gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        mine = t.to(comm_device(self.process_group))
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.process_group)
        return [e.cpu() for e in every]


def as_group(group: Group | dist.ProcessGroup | None) -> Group:
    """`group` itself when it is a `Group`, else the process group (None: the default one)
    wrapped as one."""
    if hasattr(group, "all_reduce_max"):
        return group
    return WorldGroup(group)


def min_max(
    local: torch.Tensor, group: Group | dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The element-wise minimum and maximum over the group of an int64 tensor whose shape
    every rank shares (module docstring), on the CPU: one all-reduce of twice its size."""
    local = local.to(torch.int64)
    both = as_group(group).all_reduce_max(torch.cat([local, ~local]))
    n = local.shape[0]
    return ~both[n:], both[:n]


def agree(values: list[int], group: Group | dist.ProcessGroup | None) -> list[bool]:
    """Per value: is it the same on every rank? (`min_max` of the values, compared.)"""
    low, high = min_max(torch.tensor(values, dtype=torch.int64), group)
    return (low == high).tolist()


def who_differs(group: Group, rows: torch.Tensor) -> list[tuple[int, tuple[int, ...], list]]:
    """For each row of `rows` (the values, or fingerprint words, of one thing the ranks
    disagree on; the same rows on every rank): (the reference rank, the ranks that differ
    from it, every rank's row as a tuple). The reference holds the row most ranks hold (the
    lowest such rank on a tie). One gather, made only after a mismatch; none for no rows."""
    if rows.shape[0] == 0:
        return []
    every = group.gather_tensor(rows.to(torch.int64).cpu())
    out = []
    for j in range(rows.shape[0]):
        per_rank = [tuple(e[j].reshape(-1).tolist()) for e in every]
        ref = reference_rank(per_rank)
        out.append((ref, tuple(r for r, v in enumerate(per_rank) if v != per_rank[ref]), per_rank))
    return out


def comm_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """Where collectives of this group need their tensors (CUDA for NCCL)."""
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
