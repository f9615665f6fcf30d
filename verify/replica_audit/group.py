"""The one agreement reduction of the replica audit, over a small group interface.

Every audit (a class's replicas, the matrix's cells, the shard-layout check, a script's
replicas) decides whether the ranks agree the same way: each value's minimum and maximum over
the ranks, in one MAX all-reduce of `[x, ~x]` (`~x` = -x - 1 reverses the order without
overflowing, so max(~x) is ~min(x)). Equal minimum and maximum mean every rank holds the same
value. Its size is twice the number of values, whatever the world size: agreement stays O(1)
in the number of ranks, and per-rank detail is gathered only after a mismatch (`who_differs`:
every rank's values of the rows that disagree, the reference rank and the ranks that differ).

A group is anything with `rank`, `size`, `all_reduce_max`, `gather_tensor` and `broadcast`:
`WorldGroup` wraps a `torch.distributed` process group (the class checks' world group, or the
matrix's own gloo group); the script audit's `SideGroup` (`verify/script_audit/side_group.py`)
is another. `gather_ints`, `broadcast_text` and the text gathers are built on those.
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
        """The element-wise maximum over the ranks of an integer tensor (int64, or uint8), on
        the CPU (`values` may be overwritten)."""
        ...

    def gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (a CPU tensor of one shape and dtype on every rank), on the CPU,
        in rank order."""
        ...

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """`t` (a CPU tensor of one shape and dtype on every rank) as rank `src` of the group
        holds it, on the CPU."""
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

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        staged = t.to(comm_device(self.process_group))
        dist.broadcast(staged, src=dist.get_global_rank(self.process_group, src),
                       group=self.process_group)  # fmt: skip
        return staged.cpu()


def gather_ints(group: Group, values: list[int]) -> list[list[int]]:
    """Every rank's list of int64 values (the same length on every rank), in rank order."""
    return [t.tolist() for t in group.gather_tensor(torch.tensor(values, dtype=torch.int64))]


def broadcast_text(group: Group, text: str, src: int) -> str:
    """A string rank `src` holds (two broadcasts: its length, then its bytes)."""
    data = text.encode() if group.rank == src else b""
    n = int(group.broadcast(torch.tensor([len(data)], dtype=torch.int64), src).item())
    buf = torch.zeros(n, dtype=torch.uint8)
    if group.rank == src:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return bytes(group.broadcast(buf, src).tolist()).decode()


def gather_texts(group: Group, text: str, limit: int) -> list[str]:
    """Every rank's `text`, cut to `limit` bytes of UTF-8 (`fit`), in rank order: one gather
    of a fixed size, whatever each rank has to say."""
    data = fit(text, limit).encode().ljust(limit, b"\0")
    texts = group.gather_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in texts]


def gather_whole_texts(group: Group, text: str) -> list[str]:
    """Every rank's `text`, whole, in rank order: the byte counts gathered first, then one
    gather padded to the longest (for what must not be cut: the names each rank holds, once
    the ranks found they hold different ones)."""
    data = text.encode()
    counts = [n for (n,) in gather_ints(group, [len(data)])]
    padded = torch.zeros(max(max(counts), 1), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    texts = group.gather_tensor(padded)
    return [bytes(t[:n].tolist()).decode() for t, n in zip(texts, counts, strict=True)]


def fit(text: str, limit: int) -> str:
    """`text` cut to at most `limit` bytes of UTF-8 at a separator (", " or "; "), never
    mid-name, with ", ..." where it was cut."""
    if len(text.encode()) <= limit:
        return text
    cut = text.encode()[: limit - 5].decode(errors="ignore")
    at = max(cut.rfind(", "), cut.rfind("; "))
    return (cut[:at] if at > 0 else cut) + ", ..."


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
