"""The audit's own process group: gloo, created by the tool, beside the script's groups.

The audit never enters the user's collective stream: a collective it issued on the script's
group would take a place in that group's sequence and could pair with a collective of the
script on a rank that is one step behind. So it builds a gloo group of its own, over the
script's store under a prefix of its own (`ProcessGroupGloo` directly, not `new_group`,
which would take a number in the script's own sequence of groups), and talks to it through
the group object, not `torch.distributed`'s functions, so the collective tracer and the race
sanitizer never see it. With an NCCL script the values travel as small CPU tensors.

Before it is made, the audited ranks agree that every rank is audited (`roll_call.py`: a
launcher that cleans its workers' environment starts ranks that run nothing of the tool), so
none waits for a peer that will never come; and it listens on loopback where every rank runs
on this machine (`launching/loopback.py`), else on the device torch's own groups use.

It is a `Group` of the replica audit's engine (`verify/replica_audit/group.py`): whether the
ranks agree is decided there, by the one agreement reduction every audit uses.

Every method is a collective: every rank calls them in the same order, with tensors of the
same size (the callers decide sizes from values all ranks agreed on, never from rank-local
shapes).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from verify.launching import loopback, roll_call

PREFIX = "ddp-verify/audit/"
TIMEOUT = datetime.timedelta(minutes=30)  # a rank that never comes is the watchdog's to call


class NotAudited(RuntimeError):
    """A rank of the job is no rank of the tool's: the audit cannot compare with it."""


class SideGroup:
    """A gloo group over the default group's ranks, made at the first use."""

    def __init__(self) -> None:
        self._pg = None
        self._default = None  # the default group it was made for
        self.rank, self.size = 0, 1
        self.interface: str | None = None  # what the group listens on (None: torch's default)

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
        """The group, made at the first collective: once every rank is known to be audited
        (`roll_call.absent`; else NotAudited, which stops the audit on every audited rank
        alike), on loopback where every rank runs on this machine (`loopback.py`)."""
        if self._pg is None:
            missing = roll_call.absent(self.size)
            if missing:
                raise NotAudited(roll_call.said(missing))
            store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
            self._pg, self.interface = loopback.gloo_group(store, self.rank, self.size, TIMEOUT)
        return self._pg

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum over all ranks of an integer CPU tensor, in place: the
        engine's group interface (`verify/replica_audit/group.py`)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._group().allreduce([values], opts).wait()
        return values

    def max(self, values: list[int]) -> list[int]:
        """The element-wise maximum over all ranks of a list of int64 values."""
        return self.all_reduce_max(torch.tensor(values, dtype=torch.int64)).tolist()

    def sum(self, values: list[int]) -> list[int]:
        """The element-wise sum over all ranks of a list of int64 values."""
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._group().allreduce([t], opts).wait()
        return t.tolist()

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
