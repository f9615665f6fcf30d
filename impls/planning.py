"""Bucket planning: which gradients travel together, as a pure function of parameter sizes.

Kept free of torch.distributed so it can be unit-tested in one process and so every rank,
given the same parameters, computes the same plan without communicating.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MB = 1024 * 1024  # bucket sizes are in MiB, as PyTorch DDP's bucket_cap_mb


@dataclass(frozen=True)
class ParamInfo:
    """What planning needs to know about one parameter."""

    nbytes: int
    group: Hashable  # parameters only share a bucket within a group: (device, dtype)


def plan_buckets(params: Sequence[ParamInfo], bucket_size_mb: float | None) -> list[list[int]]:
    """Group parameter indices into buckets of at most `bucket_size_mb`, in launch order.

    Parameters are taken in reverse registration order (the order backward usually produces
    their gradients) and appended to the open bucket of their (device, dtype) group; a bucket is
    closed when the next parameter would push it past the cap. A parameter larger than the cap
    gets a bucket of its own. Buckets are ordered by when their *last* gradient is expected, so
    launching them in list order follows backward.

    `bucket_size_mb=None` means no cap: one bucket per group.

    Returns a list of buckets, each a list of indices into `params` (in reverse registration
    order within the bucket). Every index appears exactly once.
    """
    if bucket_size_mb is not None and not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be > 0 or None, got {bucket_size_mb}")
    cap = math.inf if bucket_size_mb is None else bucket_size_mb * MB
    # A bucket is ready when its last member's gradient is: order buckets by that position.
    closed: list[tuple[int, list[int]]] = []  # (position of the last member, members)
    open_buckets: dict[Hashable, tuple[list[int], int, int]] = {}  # group -> (members, bytes, last)
    for position, index in enumerate(reversed(range(len(params)))):
        info = params[index]
        members, size, last = open_buckets.get(info.group, ([], 0, position))
        if members and size + info.nbytes > cap:
            closed.append((last, members))
            members, size = [], 0
        members.append(index)
        open_buckets[info.group] = (members, size + info.nbytes, position)
    closed.extend((last, members) for members, _, last in open_buckets.values())
    closed.sort(key=lambda item: item[0])
    return [members for _, members in closed]


@dataclass(frozen=True)
class SegmentPlan:
    """Where each member of a bucket sits in a buffer that one reduce-scatter splits by owner.

    The buffer is `world_size` equal segments of `segment` elements; segment r holds, in
    bucket order, the members rank r owns, followed by zero padding up to `segment`.

    Attributes:
        segment: elements per segment (the largest rank's share of the bucket).
        offsets: offsets[i] is where member i starts in the whole buffer.
        padding: zero elements the buffer carries, summed over segments.
    """

    segment: int
    offsets: tuple[int, ...]
    padding: int


def plan_segments(sizes: Sequence[int], owners: Sequence[int], world_size: int) -> SegmentPlan:
    """Lay out a bucket's members (`sizes` in elements, `owners` their ranks) by owner rank.

    A reduce-scatter leaves segment r, summed over ranks, on rank r: rank r receives exactly
    the gradients it owns. Padding is the price of whole-parameter ownership: the segment is
    the largest rank's share, so a bucket owned by one rank costs world_size times its size on
    the wire (`impls.zero2` says when that matters). Pure: every rank computes the same plan.

    Raises:
        ValueError: `sizes` and `owners` differ in length, or an owner is outside the world.
    """
    if len(sizes) != len(owners):
        raise ValueError(f"{len(sizes)} sizes but {len(owners)} owners")
    if any(not 0 <= o < world_size for o in owners):
        raise ValueError(f"owners must be ranks in 0..{world_size - 1}, got {sorted(set(owners))}")
    shares = [0] * world_size
    starts = []  # each member's start within its owner's segment
    for size, owner in zip(sizes, owners):
        starts.append(shares[owner])
        shares[owner] += size
    segment = max(shares, default=0)
    offsets = tuple(owner * segment + start for owner, start in zip(owners, starts))
    return SegmentPlan(segment, offsets, segment * world_size - sum(sizes))
