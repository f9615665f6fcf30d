"""Which rank owns which parameter under ZeRO-1: a pure, deterministic planning function.

`partition_parameters(sizes, world_size)` assigns every parameter (a whole tensor, never a
slice) to one rank so that the most-loaded rank holds as few bytes of optimizer state as the
sizes allow. No `torch.distributed` here: every rank calls it on the same sizes and gets the
same plan, so no collective is needed to agree on it.

Why whole parameters: an optimizer that reads a whole tensor at once (per-tensor norms as in
LAMB, LARS or Muon's orthogonalisation, Adafactor's row/column factors) stays correct when
each rank steps whole tensors; slicing a tensor across ranks would change its math.

Algorithm:
  1. LPT (longest processing time first): all parameters at once, largest first, each to the
     currently least-loaded rank (ties: lower parameter index first, lower rank first).
  2. Local search: take the most-loaded rank `m`; among all moves of one item from `m` to
     another rank `r`, and swaps of an item on `m` with a smaller item on `r`, apply the one
     that leaves max(load[m], load[r]) lowest, if that is below the old load[m]. Each applied
     move makes the sorted load vector lexicographically smaller, so this cannot cycle; stop
     when no move improves or after `max_rounds` rounds.

Guarantee: LPT alone is within 4/3 - 1/(3N) of the optimal max load (Graham, 1969); local
search only lowers the max, and stops early once the max reaches `ShardPlan.bound`, a lower
bound on any whole-parameter partition. In practice the max load is at or within a few
percent of that bound (GPT layouts, random lists); what remains is the granularity of the
sizes. Above 1/N by more than that is unavoidable with whole parameters: when one tensor
is bigger than total/N (GPT-2's 154 MB embedding at N=4), the bound is that tensor.

PyTorch's `ZeroRedundancyOptimizer` runs the same greedy one parameter group at a time and
counts elements, not bytes: fine when the big tensors come in the first group (nanoGPT's
decay/no-decay split), 1.2-1.4x of 1/N when they come later (nanochat-style groups), and it
refuses mixed dtypes outright.
"""

from __future__ import annotations

import bisect
import heapq
import operator
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardPlan:
    """Owner of every parameter and the bytes each rank owns.

    Attributes:
        owners: owners[i] is the rank that owns parameter i (index into the `sizes` list).
        loads: bytes owned by each rank; len(loads) == world_size.
        total: sum of all sizes.
        world_size: number of ranks the plan is for.
        largest: size of the largest parameter (what `bound` needs beyond the loads).
    """

    owners: tuple[int, ...]
    loads: tuple[int, ...]
    total: int
    world_size: int
    largest: int = 0

    @property
    def ideal(self) -> float:
        """The perfectly even share, total / world_size (not reachable in general)."""
        return self.total / self.world_size

    @property
    def bound(self) -> int:
        """A lower bound on the max load of any whole-parameter partition.

        No rank can hold less than ceil(total / N) bytes at the max, and the rank that gets
        the largest parameter holds at least that parameter.
        """
        return max(self.largest, -(-self.total // self.world_size))

    @property
    def imbalance(self) -> float:
        """max(loads) / ideal: 1.0 is a perfect split; 1.0 when there is nothing to split."""
        return max(self.loads) / self.ideal if self.total else 1.0

    def indices(self, rank: int) -> tuple[int, ...]:
        """Indices of the parameters `rank` owns, ascending."""
        return tuple(i for i, r in enumerate(self.owners) if r == rank)


def partition_parameters(
    sizes: Sequence[int], world_size: int, *, max_rounds: int = 128
) -> ShardPlan:
    """Assign whole parameters to `world_size` ranks, minimising the largest rank's bytes.

    Args:
        sizes: bytes of each parameter (numel * element_size), in a fixed global order.
        world_size: number of ranks; may exceed len(sizes) (some ranks then own nothing).
        max_rounds: cap on local-search moves after LPT (each round is O(n log n)).

    Returns:
        A ShardPlan. Deterministic: the same arguments give the same plan on every rank.

    Raises:
        ValueError: if world_size < 1 or any size is negative.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    sizes = [operator.index(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"parameter sizes must be >= 0, got {min(sizes)}")
    owners = [0] * len(sizes)
    loads = [0] * world_size

    # 1. LPT. The heap holds (load, rank), so the least-loaded rank with the lowest index pops.
    heap = [(0, r) for r in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        owners[i], loads[r] = r, load + sizes[i]
        heapq.heappush(heap, (loads[r], r))

    # 2. Local search. members[r] is sorted by (size, index) so equal-size items resolve to
    # the lowest index, keeping the result independent of anything but the inputs.
    if world_size > 1:
        members: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        for i, r in enumerate(owners):
            members[r].append((sizes[i], i))
        for m in members:
            m.sort()
        bound = max(max(sizes, default=0), -(-sum(sizes) // world_size))
        for _ in range(max_rounds):
            if max(loads) == bound:
                break  # provably optimal; nothing left to gain
            move = _best_move(members, loads)
            if move is None:
                break
            m, r, a, b = move  # item a (on m) goes to r; item b (on r, or None) comes back
            _transfer(members, loads, owners, a, m, r)
            if b is not None:
                _transfer(members, loads, owners, b, r, m)

    return ShardPlan(
        owners=tuple(owners),
        loads=tuple(loads),
        total=sum(sizes),
        world_size=world_size,
        largest=max(sizes, default=0),
    )


def assigned_plan(sizes: Sequence[int], owners: Sequence[int], world_size: int) -> ShardPlan:
    """The ShardPlan of an ownership decided elsewhere (ZeRO-2's wrapper decides it, so the
    optimizer steps exactly the parameters whose gradients the wrapper leaves on this rank).

    Raises:
        ValueError: lengths differ, or an owner is not a rank in 0..world_size-1.
    """
    if len(sizes) != len(owners):
        raise ValueError(f"{len(sizes)} sizes but {len(owners)} owners")
    loads = [0] * world_size
    for size, owner in zip(sizes, owners):
        if not 0 <= owner < world_size:
            raise ValueError(f"owner {owner} is not a rank in 0..{world_size - 1}")
        loads[owner] += size
    return ShardPlan(tuple(owners), tuple(loads), sum(sizes), world_size, max(sizes, default=0))


def _best_move(
    members: list[list[tuple[int, int]]], loads: list[int]
) -> tuple[int, int, tuple[int, int], tuple[int, int] | None] | None:
    """The move or swap off the most-loaded rank that best balances it with one other rank.

    Moving net bytes d from m to r (0 < d < D = load[m] - load[r]) leaves the pair at
    max(load[m] - d, load[r] + d), lowest when d is nearest D / 2. A move has d = size(a); a
    swap has d = size(a) - size(b), so for each size on m we bisect r's sizes (plus a virtual
    0 for "no item back") for the one nearest size(a) - D / 2.
    """
    m = max(range(len(loads)), key=lambda r: (loads[r], -r))
    best, best_key = None, None
    m_items = members[m]
    for r in range(len(loads)):
        span = loads[m] - loads[r]  # D
        if r == m or span <= 0:
            continue
        back = [(0, -1)] + members[r]  # (0, -1) is "move without swap"
        back_sizes = [s for s, _ in back]
        prev = None
        for a in m_items:
            if a[0] == 0 or a[0] == prev:
                continue  # zero-size moves change nothing; equal sizes: first index wins
            prev = a[0]
            k = bisect.bisect_left(back_sizes, a[0] - span // 2)
            for j in (k - 1, k):
                if not 0 <= j < len(back):
                    continue
                d = a[0] - back_sizes[j]
                if not 0 < d < span:
                    continue
                # Among equal sizes on r, take the lowest index (the first in sorted order).
                j = bisect.bisect_left(back_sizes, back_sizes[j])
                key = (max(loads[m] - d, loads[r] + d), r, a[1], back[j][1])
                if best_key is None or key < best_key:
                    best_key = key
                    best = (m, r, a, None if back[j][1] < 0 else back[j])
    return best


def _transfer(members, loads, owners, item: tuple[int, int], src: int, dst: int) -> None:
    members[src].remove(item)
    bisect.insort(members[dst], item)
    loads[src] -= item[0]
    loads[dst] += item[0]
    owners[item[1]] = dst
