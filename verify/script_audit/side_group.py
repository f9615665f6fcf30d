"""The audit's own process group: gloo, created by the tool, beside the script's groups.

The audit never enters the user's collective stream: a collective it issued on the script's
group would take a place in that group's sequence and could pair with a collective of the
script on a rank that is one step behind. So it builds a gloo group of its own, over the
script's store under a prefix of its own (`ProcessGroupGloo` directly, not `new_group`,
which would take a number in the script's own sequence of groups), and talks to it through
the group object, not `torch.distributed`'s functions, so the collective tracer and the race
sanitizer never see it. With an NCCL script the values travel as small CPU tensors.

Every method is a collective: every rank calls them in the same order, with tensors of the
same size (the callers decide sizes from values all ranks agreed on, never from rank-local
shapes).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

PREFIX = "ddp-verify/audit/"
TIMEOUT = datetime.timedelta(minutes=30)  # a rank that never comes is the watchdog's to call


class SideGroup:
    """A gloo group over the default group's ranks, made at the first use."""

    def __init__(self) -> None:
        self._pg = None
        self._default = None  # the default group it was made for
        self.rank, self.size = 0, 1

    def ready(self) -> bool:
        """True when there are ranks to compare with (a process group of 2 or more)."""
        if not (dist.is_available() and dist.is_initialized()):
            return False
        default = dist.distributed_c10d._get_default_group()
        if default is not self._default:  # first use, or the script made a new default group
            self._default, self._pg = default, None
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        return self.size > 1

    def _group(self):
        if self._pg is None:
            store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.size, TIMEOUT)
        return self._pg

    def max(self, values: list[int]) -> list[int]:
        """The element-wise maximum over all ranks of a list of int64 values."""
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._group().allreduce([t], opts).wait()
        return t.tolist()

    def sum(self, values: list[int]) -> list[int]:
        """The element-wise sum over all ranks of a list of int64 values."""
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._group().allreduce([t], opts).wait()
        return t.tolist()

    def agree(self, values: list[int]) -> list[bool]:
        """Per value: is it the same on every rank? One all-reduce of 2 x len(values) words,
        whatever the world size: the maximum of x and of ~x (= -x - 1, which reverses the
        order without overflowing) give the maximum and the minimum."""
        n = len(values)
        both = self.max(values + [~v for v in values])
        return [both[i] == ~both[n + i] for i in range(n)]

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of int64 values (the same length on every rank)."""
        return [t.tolist() for t in self.gather_tensor(torch.tensor(values, dtype=torch.int64))]

    def gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._group().allgather([out], [t]).wait()
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """`t` (a CPU tensor of the same shape and dtype on every rank) as rank `src` holds it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._group().broadcast([t], opts).wait()
        return t

    def broadcast_text(self, text: str, src: int) -> str:
        """A string held by rank `src` (two broadcasts: its length, then its bytes)."""
        data = text.encode() if self.rank == src else b""
        n = self.broadcast(torch.tensor([len(data)], dtype=torch.int64), src).item()
        buf = torch.zeros(int(n), dtype=torch.uint8)
        if self.rank == src:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return bytes(self.broadcast(buf, src).tolist()).decode()
