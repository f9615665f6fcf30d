"""Bitwise replica audit: are parameters, buffers, gradients and optimizer state identical on
every rank? Decided by exchanging per-tensor fingerprints, not tensors.

A fingerprint is computed from the tensor's raw bits, read as integer words:

- the wrapping 64-bit sum of all words, and
- the wrapping sum of 256-word row sums weighted by row position,

plus a code for dtype and shape, and a flag for a missing tensor (a `.grad` that is None).
Any change to a single element changes the first sum (the difference of one word is nonzero
and smaller than 2**64), so a one-ULP change anywhere is always caught; the weighted sum also
catches values moved between rows. Distinct tensors can collide only when several elements
change in exactly compensating ways in both sums at once. Integer addition is associative, so
the fingerprint does not depend on how the reduction is ordered or threaded.

All ranks gather every rank's fingerprints (one small all-gather), so all ranks agree on
which tensors mismatch. Only for those (at most `max_detail`) do they gather the tensor itself
to say which ranks differ, by how much, in how many elements, and where first.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

_ROW = 256  # words per row of the position-weighted sum (wider rows: one pass at memory speed)
_MISSING = -1  # metadata code of a tensor that does not exist on this rank (None grad)


@dataclass(frozen=True)
class Mismatch:
    """One tensor that is not bitwise identical on every rank, at one checkpoint."""

    checkpoint: str
    tensor: str
    ranks: tuple[int, ...]  # ranks whose tensor differs from the reference rank's
    reference_rank: int  # the rank holding the majority value (rank 0 on a tie)
    max_abs_diff: float | None  # None when shapes/dtypes differ or the tensor is missing
    num_different: int | None
    numel: int | None
    first_index: tuple[int, ...] | None
    detail: str = ""  # e.g. "grad is None on ranks [1]", "shape (4,) vs (2, 2)"

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        head = f"{self.checkpoint}: {self.tensor} differs on rank{'s' if len(self.ranks) > 1 else ''} {ranks} (vs rank {self.reference_rank})"
        if self.detail:
            return f"{head}: {self.detail}"
        if self.num_different is None:
            return head
        return (
            f"{head}: max |diff| {self.max_abs_diff:.3g}, {self.num_different}/{self.numel} "
            f"elements differ, first at index {list(self.first_index)}"
        )


@dataclass(frozen=True)
class Checkpoint:
    """What one audit looked at and how long it took."""

    label: str
    tensors: int
    mismatched: int
    seconds: float


def fingerprint(tensor: torch.Tensor | None) -> torch.Tensor:
    """Three int64 values identifying `tensor` bitwise: (metadata, word sum, weighted sum)."""
    if tensor is None:
        return torch.tensor([_MISSING, 0, 0], dtype=torch.int64)
    t = tensor.detach()
    meta = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel() == 0:
        return torch.tensor([meta, 0, 0], dtype=torch.int64)
    if not t.is_contiguous():
        t = t.contiguous()
    words = _as_words(t.reshape(-1))
    full = words.numel() // _ROW * _ROW
    rows = words[:full].view(-1, _ROW).sum(dim=1, dtype=torch.int64)
    tail = words[full:].sum(dtype=torch.int64)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=rows.device)
    total = rows.sum() + tail
    weighted = (rows * weights).sum() + tail * (rows.numel() + 1)
    return torch.stack([torch.tensor(meta, device=total.device), total, weighted]).cpu()


def _as_words(flat: torch.Tensor) -> torch.Tensor:
    """Reinterpret `flat`'s bytes as the widest integer words its byte size allows.

    The width depends only on dtype and size, never on where the tensor sits in memory, so the
    same values fingerprint the same on every rank. A tensor whose storage offset is not
    aligned to that width (a view into a flat buffer) is copied first.
    """
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            if (flat.storage_offset() * flat.element_size()) % size:
                flat = flat.clone()
            return flat.view(torch.uint8).view(dtype)
    return flat.view(torch.uint8)


class Auditor:
    """Audits named tensors of a model (and optionally a replicated optimizer's state).

    Collective: `audit` must be called on all ranks at the same checkpoints with the same
    tensor names, or it hangs.

    Args:
        model: the *unwrapped* model (names are its `named_parameters()` names).
        optimizer: a replicated optimizer whose state should be identical on every rank, or
            None (sharded optimizers keep different state per rank by design).
        process_group: the group whose ranks are compared.
        max_detail: at most this many mismatched tensors are gathered for a detailed report.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        max_detail: int = 8,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.max_detail = max_detail
        self.param_names = {id(p): n for n, p in model.named_parameters()}

    def state_tensors(self) -> list[tuple[str, torch.Tensor | None]]:
        """Parameters, buffers and replicated optimizer state, by name."""
        named = [(f"param:{n}", p) for n, p in self.model.named_parameters()]
        named += [(f"buffer:{n}", b) for n, b in self.model.named_buffers()]
        if self.optimizer is not None:
            for param, state in self.optimizer.state.items():
                name = self.param_names.get(id(param), "?")
                for key in sorted(state):
                    value = state[key]
                    if not isinstance(value, torch.Tensor):
                        value = torch.tensor(value)
                    named.append((f"optim:{name}.{key}", value))
        return named

    def grad_tensors(self) -> list[tuple[str, torch.Tensor | None]]:
        """Gradients of trainable parameters, by name (None where a rank has no gradient)."""
        return [(f"grad:{n}", p.grad) for n, p in self.model.named_parameters() if p.requires_grad]

    def audit(
        self, label: str, named: list[tuple[str, torch.Tensor | None]]
    ) -> tuple[Checkpoint, list[Mismatch]]:
        """Compare `named` tensors across ranks; every rank returns the same answer."""
        if self.world_size > 1:
            # Ranks arrive at different times; the timer must not count waiting for the slowest.
            dist.barrier(group=self.process_group)
        start = time.perf_counter()
        local = torch.stack([fingerprint(t) for _, t in named]) if named else torch.zeros(0, 3)
        local = local.to(torch.int64)
        if self.world_size == 1:
            return Checkpoint(label, len(named), 0, time.perf_counter() - start), []
        device = _comm_device(self.process_group)
        gathered = [torch.empty_like(local, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, local.to(device), group=self.process_group)
        prints = torch.stack([g.cpu() for g in gathered])  # [rank, tensor, 3]
        bad = [i for i in range(len(named)) if not bool((prints[:, i] == prints[0, i]).all())]
        mismatches = [
            self._explain(label, named[i], prints[:, i], detailed=k < self.max_detail)
            for k, i in enumerate(bad)
        ]
        seconds = time.perf_counter() - start
        return Checkpoint(label, len(named), len(bad), seconds), mismatches

    def _explain(
        self,
        label: str,
        item: tuple[str, torch.Tensor | None],
        prints: torch.Tensor,
        *,
        detailed: bool,
    ) -> Mismatch:
        name, tensor = item
        keys = [tuple(p.tolist()) for p in prints]
        # The reference is the most common value; ties go to the lowest rank.
        counts = {k: keys.count(k) for k in keys}
        reference = max(range(len(keys)), key=lambda r: (counts[keys[r]], -r))
        differ = tuple(r for r in range(len(keys)) if keys[r] != keys[reference])
        missing = [r for r in range(len(keys)) if keys[r][0] == _MISSING]
        if missing:
            return Mismatch(
                label, name, differ, reference, None, None, None, None,
                detail=f"the tensor is None on rank{'s' if len(missing) > 1 else ''} {missing}",
            )  # fmt: skip
        if len({k[0] for k in keys}) > 1:
            return Mismatch(
                label, name, differ, reference, None, None, None, None,
                detail="dtype or shape differs between ranks",
            )  # fmt: skip
        if not detailed:
            return Mismatch(label, name, differ, reference, None, None, None, None)
        return _compare_gathered(label, name, tensor, differ, reference, self.process_group)


def _compare_gathered(label, name, tensor, differ, reference, process_group) -> Mismatch:
    """Gather `tensor` from every rank and measure how the differing ranks differ."""
    device = _comm_device(process_group)
    t = tensor.detach().contiguous().to(device)
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(copies, t, group=process_group)
    ref = copies[reference].cpu()
    worst, count, first = 0.0, 0, None
    ref_bits = _element_bits(ref)
    for r in differ:
        other = copies[r].cpu()
        # Bitwise: NaN-safe, and -0.0 vs 0.0 counts as a difference.
        unequal = ref_bits.ne(_element_bits(other))
        count = max(count, int(unequal.sum()))
        if unequal.any():
            flat_first = int(unequal.nonzero()[0])
            first = flat_first if first is None else min(first, flat_first)
        diff = (ref.double() - other.double()).abs().reshape(-1)
        worst = max(worst, float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0)
    first = first or 0
    index = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(first), ref.shape))
        if ref.dim()
        else ()
    )
    return Mismatch(label, name, differ, reference, worst, count, ref.numel(), index)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _element_bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as same-width integers (complex and bool handled)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_BITS[flat.element_size()])


def _comm_device(process_group) -> torch.device:
    """Where collectives of this group need their tensors (CUDA for NCCL)."""
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
