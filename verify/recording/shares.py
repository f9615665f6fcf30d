"""Who sketches what when the ranks of `audit --record` share the sketching (`recorder.py`),
and one rank's part of it.

The step waits for the slowest rank, so the ranks' shares are balanced by the work, not by
the count of tensors: the blocks of all the tensors of an audit point (`sketch.py`: up to 16
a tensor), in the entries' order, are laid end to end, each weighing its element count (the
first block of a tensor also its fixed cost, `OVERHEAD`), and cut into `size` contiguous runs
of about equal weight. A rank's share is then a few whole tensors and at most two parts of
tensors (rows of their sketches), and no rank's share is more than one block's weight over
1/size of the whole. Handing out whole tensors by turn, as before, left one rank 61% of the
elements of the benchmark's transformer (its largest tensor is three times the next).

`plan` is a pure function of the element counts and the world size: every rank computes it
from its own list, before the audit compares the lists; where the comparison finds them the
same, every rank computed the same plan, and the owner knows, without being told, which rows
of which rank's share are which tensor's (where not, the shares are not put together:
`recorder.py`). A block's two numbers do not depend on which rank, or
with which other blocks, it was computed (`sketch.block_rows`): the owner's table is, bit for
bit, the one a rank alone would compute.

`Part` is one rank's part: it fingerprints every tensor (the engine's `fingerprints`, which
the audit's comparison reuses rather than computing again) and sketches its share of each
right after the tensor's words were read for the fingerprint, from the cache.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from verify.recording.sketch import BLOCKS, COLUMNS, block_counts, block_rows, blocks_used
from verify.replica_audit.fingerprint import fingerprints

# A tensor's fixed cost, in elements: the reductions and the bookkeeping a piece of a sketch
# costs however small the tensor (14 us on one EPYC core, where 64K float32 elements of a
# tensor just read for its fingerprint take as long), so that the shares balance time, not
# elements alone (the benchmark's transformer has 67 tensors of 704 to 100K elements).
OVERHEAD = 65536

Piece = tuple[int, int, int]  # (tensor index, first block, end block)


def plan(numels: list[int], size: int) -> list[list[Piece]]:
    """Each rank's share (module docstring) of sketching tensors of `numels` elements (as
    `sketch.sketched_numel` counts them) among `size` ranks: per rank, its pieces in order.
    The rows of a rank's share are its pieces' blocks, in that order."""
    blocks = []  # (tensor, block, weight), end to end
    for i, n in enumerate(numels):
        counts = block_counts(n)
        blocks += [(i, b, int(counts[b]) + (OVERHEAD if b == 0 else 0))
                   for b in range(blocks_used(n))]  # fmt: skip
    total = sum(w for _, _, w in blocks)
    shares: list[list[Piece]] = [[] for _ in range(size)]
    start = 0
    for i, b, w in blocks:
        # the rank whose run holds the block's midpoint: integers, the same on every rank
        rank = min(size - 1, (2 * start + w) * size // (2 * total))
        start += w
        mine = shares[rank]
        if mine and mine[-1][0] == i and mine[-1][2] == b:
            mine[-1] = (i, mine[-1][1], b + 1)
        else:
            mine.append((i, b, b + 1))
    return shares


@dataclass(frozen=True)
class Plan:
    """`plan`'s shares, with what a rank needs of them besides."""

    shares: tuple[tuple[Piece, ...], ...]
    capacity: int  # the rows of the largest share: what every rank sends
    elements: tuple[int, ...]  # each rank's


@functools.lru_cache(maxsize=16)
def planned(numels: tuple[int, ...], size: int) -> Plan:
    """`plan(numels, size)`, kept for the last few layouts: an audit point's entries are the
    same from one step to the next, and planning 100 tensors takes 3 ms of Python."""
    shares = plan(list(numels), size)
    return Plan(
        tuple(tuple(share) for share in shares),
        max(map(rows, shares)),
        tuple(elements(share, list(numels)) for share in shares),
    )


def weight(share: list[Piece], numels: list[int]) -> int:
    """What `plan` balances: a share's elements, and `OVERHEAD` for each first block in it."""
    return elements(share, numels) + OVERHEAD * sum(first == 0 for _, first, _ in share)


def rows(share: list[Piece]) -> int:
    """How many sketch rows (blocks) a share holds."""
    return sum(end - first for _, first, end in share)


class Part:
    """One rank's part of an audit point's recording (module docstring): `fingerprints` of
    every tensor, and `table`, the [capacity, COLUMNS] float32 rows of its share (zero
    beyond them, so that every rank sends the same size); `seconds`: the time spent
    sketching, and `fingerprint_seconds` fingerprinting (the audit's own work, reused)."""

    def __init__(self, tensors: list[torch.Tensor], share: list[Piece], capacity: int) -> None:
        by_tensor: dict[int, list[tuple[int, int]]] = {}
        for i, first, end in share:
            by_tensor.setdefault(i, []).append((first, end))
        done: list[torch.Tensor] = []
        self.seconds = 0.0

        def sketch_share(i: int) -> None:
            start = time.perf_counter()
            for first, end in by_tensor.get(i, ()):
                done.append(block_rows(tensors[i], first, end))
            self.seconds += time.perf_counter() - start

        start = time.perf_counter()
        self.fingerprints = fingerprints(tensors, each=sketch_share)
        self.fingerprint_seconds = time.perf_counter() - start - self.seconds
        start = time.perf_counter()
        self.table = torch.zeros(max(capacity, 1), COLUMNS, dtype=torch.float32)
        if done:
            one = len({d.device for d in done}) == 1  # one copy; else one a piece
            table = torch.cat(done).cpu() if one else torch.cat([d.cpu() for d in done])
            self.table[: len(table)] = table
        self.seconds += time.perf_counter() - start


def assemble(shares: list[list[Piece]], tables: list[torch.Tensor], count: int) -> np.ndarray:
    """The [count, BLOCKS, COLUMNS] sketches of the `count` tensors `shares` were planned for,
    from every rank's `Part.table` (in rank order); blocks no tensor uses stay zero."""
    out = np.zeros((count, BLOCKS, COLUMNS), dtype=np.float32)
    for share, table in zip(shares, tables):
        got, at = table.numpy(), 0
        for i, first, end in share:
            out[i, first:end] = got[at : at + end - first]
            at += end - first
    return out


def elements(share: list[Piece], numels: list[int]) -> int:
    """The elements a share sketches (`numels` as `plan` was given them)."""
    return sum(int(block_counts(numels[i])[first:end].sum()) for i, first, end in share)
