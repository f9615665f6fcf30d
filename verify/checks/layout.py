"""The shard layout check: the shards of each tensor are disjoint, cover it exactly, and each
rank's shard holds the rows of the full tensor it claims to hold.

The layout is read where it is declared, never inferred from shapes (a guess would fail a
correct design it did not foresee):

- a parameter that is a `DTensor` on a 1-D mesh over the ranks checked, placed `Shard(dim)`
  (PyTorch's FSDP2): its rows along `dim` follow `torch.chunk` (DTensor's documented
  chunking: blocks of ceil(n / N), the last one short, trailing ranks empty when n < N); a
  rank holds as many of them as its local tensor has, from its block's start. Other
  placements (`Replicate`, `Partial`, meshes of 2 or more dims) are not checked here;
- otherwise the wrapper's `shard_rows()` when it has one (optional; ZeRO-3, `impls.zero3`):
  `{name: (start, stop)}` for every parameter it shards by rows, named as the wrapped
  module's `named_parameters()` names it: this rank's parameter of that name holds rows
  `start:stop` of the full tensor as its first `stop - start` rows (further rows are padding).
  A parameter no rank names is replicated (the audit compares it whole); a rank that does
  not name one another rank names holds none of its rows.

Without either, nothing is checked and nothing is found. Each rank compares its own shard with
the full tensor put together (`training/sharded.py`) bitwise, then every rank contributes one
fixed-size record per parameter (a digest of its name, whether it declared it, dim, start,
stop, rows of the full tensor, whether its values matched) to one all-gather; the ranks first
agree on how many records there are (one min/max all-reduce), so no collective depends on a
rank-local shape. Every rank then reads the same records and finds the same things:

    shards of fc1.weight overlap: ranks 0 and 1 both hold rows 16:20
    rows 30:32 of fc1.weight held by no rank
    rank 1's shard of fc1.weight differs from rows 16:32 of the full tensor

Rows are written as slices: `16:20` is rows 16 to 19.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from verify.replica_audit.group import comm_device, min_max
from verify.training.interface import InterfaceError
from verify.training.sharded import row_block

GUIDE = "docs/verify-your-own-ddp.md"
_FIELDS = 7  # name digest, declared, dim, start, stop, rows of the full tensor, values match


@dataclass(frozen=True)
class Problem:
    """One violation of one parameter's layout."""

    kind: str  # "outside", "overlap", "uncovered" or "differs"
    tensor: str
    message: str
    ranks: tuple[int, ...]


def layout_problems(
    model: nn.Module, wrapped: nn.Module, full: dict[str, torch.Tensor], group
) -> tuple[int, list[Problem]]:
    """How many parameters some rank declared sharded, and every layout violation (module
    docstring), by parameter. A collective of `group`: call on every rank, in the same place.
    `full` maps parameter names to their full tensors (the same on every rank when the audit
    passes)."""
    declared = _declared(model, wrapped)
    names = [n for n, _ in model.named_parameters()]
    records = torch.zeros(len(names), _FIELDS, dtype=torch.int64)
    for i, name in enumerate(names):
        records[i, 0] = zlib.crc32(name.encode())
        if name in declared and name in full:
            shard, dim, start, stop = declared[name]
            rows = full[name].shape[dim] if full[name].dim() > dim else 0
            same = 0 <= start <= stop <= rows and _holds(
                shard, dim, stop - start, full[name].narrow(dim, start, stop - start)
            )
            records[i, 1:] = torch.tensor([1, dim, start, stop, rows, int(same)])
    every = _gather(records, group)
    if every is None:  # the ranks hold different parameters: the audit says which
        return 0, []
    problems = []
    for i, name in enumerate(names):
        if bool((every[:, i, 0] == every[0, i, 0]).all()):
            problems += _judge(name, every[:, i, 1:].tolist())
    return int(every[:, :, 1].any(dim=0).sum()), problems


def _declared(model: nn.Module, wrapped: nn.Module) -> dict:
    """{name: (this rank's shard, dim, start, stop)} as declared (module docstring)."""
    out = {}
    for name, p in model.named_parameters():
        spec = _dtensor_rows(p)
        if spec is not None:
            out[name] = spec
    rows = getattr(wrapped, "shard_rows", None)
    if rows is None:
        return out
    got = rows()
    params = dict(model.named_parameters())
    problem = _misfit(got, params)
    if problem:
        raise InterfaceError(
            f"{type(wrapped).__name__}.shard_rows() {problem}; it must return "
            "{name: (start, stop)} for the parameters it shards by rows, named as the wrapped "
            f"module's named_parameters() names them (see {GUIDE})"
        )
    for name, (start, stop) in got.items():
        out.setdefault(name, (params[name].detach(), 0, int(start), int(stop)))
    return out


def _dtensor_rows(p: torch.Tensor):
    """(local shard, dim, start, stop) of a DTensor placed Shard(dim) on a 1-D mesh, else None."""
    placed = row_block(p)
    if placed is None:
        return None
    (dim, block), local = placed, p.to_local().detach()
    start = min(p.device_mesh.get_local_rank() * block, p.shape[dim])
    return local, dim, start, start + local.shape[dim]


def _holds(shard: torch.Tensor, dim: int, count: int, rows: torch.Tensor) -> bool:
    """Whether the first `count` rows of `shard` along `dim` are `rows`, bitwise."""
    if shard.dim() != rows.dim() or shard.shape[dim] < count:
        return False
    mine = shard.narrow(dim, 0, count)
    if mine.shape != rows.shape:
        return False
    if mine.dtype != rows.dtype:
        mine = mine.to(rows.dtype)
    a, b = mine.contiguous().reshape(-1), rows.contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _gather(records: torch.Tensor, group) -> torch.Tensor | None:
    """Every rank's records, (ranks, tensors, fields); None when the ranks hold different
    numbers of parameters (then no records are exchanged: their size would differ)."""
    world = dist.get_world_size(group)
    device = comm_device(group)
    low, high = min_max(torch.tensor([len(records)]), group)
    if not bool((low == high).all()):  # the ranks hold different numbers of parameters
        return None
    mine = records.to(device)
    every = torch.empty((world * len(records), _FIELDS), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)  # gloo: ranks stacked along dim 0
    return every.cpu().view(world, len(records), _FIELDS)


def _judge(name: str, ranks: list[list[int]]) -> list[Problem]:
    """The violations of one parameter, from every rank's (declared, dim, start, stop, rows,
    same): the first overlap, the first uncovered rows, and every shard whose values differ."""
    held = [(r, start, stop) for r, (on, _, start, stop, _, _) in enumerate(ranks) if on]
    if not held:
        return []  # replicated: the audit compares it whole
    rows = max(ranks[r][4] for r, _, _ in held)
    out = []
    outside = [(r, a, b) for r, a, b in held if a < 0 or b < a or b > rows]
    for r, a, b in outside[:1]:
        out.append(
            Problem(
                "outside", name, f"rank {r} claims rows {a}:{b} of {name}, which has {rows}", (r,)
            )
        )
    spans = sorted((a, b, r) for r, a, b in held if b > a)
    for (_, b1, r1), (a2, b2, r2) in zip(spans, spans[1:]):
        if a2 < b1:
            lo, hi = sorted((r1, r2))
            text = (
                f"shards of {name} overlap: ranks {lo} and {hi} both hold rows {a2}:{min(b1, b2)}"
            )
            out.append(Problem("overlap", name, text, (lo, hi)))
            break
    covered = 0
    for a, b, _ in spans:
        if a > covered:
            break
        covered = max(covered, b)
    if covered < rows:
        gap_end = min([a for a, _, _ in spans if a > covered], default=rows)
        out.append(
            Problem("uncovered", name, f"rows {covered}:{gap_end} of {name} held by no rank", ())
        )
    for r, a, b in held:
        if not ranks[r][5] and (r, a, b) not in outside:
            text = f"rank {r}'s shard of {name} differs from rows {a}:{b} of the full tensor"
            out.append(Problem("differs", name, text, (r,)))
    return out


def _misfit(got: object, params: dict) -> str:
    if not isinstance(got, dict):
        return f"returned a {type(got).__name__}, not a dict"
    for name, span in got.items():
        if name not in params:
            return f"named {name!r}, not a parameter of the wrapped module"
        if not (isinstance(span, tuple | list) and len(span) == 2):
            return f"gave {span!r} for {name!r}, not a (start, stop) pair"
        if not all(isinstance(x, int) for x in span):
            return f"gave {span!r} for {name!r}: start and stop must be ints"
    return ""
