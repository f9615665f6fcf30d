"""One tensor that differs across ranks, and how it differs: measured on the gathered copies
after the audit's fingerprints disagreed (`audit.py`).

Besides where and by how much, it measures whether the differing ranks' tensor is the
reference rank's times one factor (`scale`): a gradient clipped, or loss-scaled, on some ranks
only is exactly that, with the same factor in every tensor (`hint_rules.gradients_differ`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verify.checks import kinds
from verify.replica_audit.group import comm_device

# A multiple to rounding: a factor applied in float32 leaves each element within ~1e-7 of
# c x reference (relative to max |reference|); a tensor that is no multiple is off by its own
# scale. 1e-5 sits between, far from both.
SCALE_FIT = 1e-5


@dataclass(frozen=True)
class Mismatch:
    """One tensor that is not bitwise identical on every rank, at one checkpoint.

    `kind`: "values" (same shape, different values), "missing" (None on some ranks), "shape"
    (dtype or shape differ) or "absent" (held by some ranks only: optimizer state). `scale`:
    the factor c with which every differing rank's values are c x the reference rank's, to
    rounding (`SCALE_FIT`); None when they are no multiple, or were not gathered."""

    checkpoint: str
    tensor: str
    ranks: tuple[int, ...]  # ranks whose tensor differs from the reference rank's
    reference_rank: int  # the rank holding the majority value (rank 0 on a tie)
    max_abs_diff: float | None  # None when shapes/dtypes differ or the tensor is missing
    num_different: int | None
    numel: int | None
    first_index: tuple[int, ...] | None
    detail: str = ""  # e.g. "grad is None on ranks [1]", "shape (4,) vs (2, 2)"
    kind: str = "values"
    scale: float | None = None
    # The fingerprints differed but the tensors gathered right after are equal on every rank:
    # the values moved between the two reads, so something (a collective) still wrote them.
    moved: bool = False

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


def compare_gathered(label, name, tensor, differ, reference, process_group) -> Mismatch:
    """Gather `tensor` from every rank and measure how the differing ranks differ."""
    device = comm_device(process_group)
    t = tensor.detach().contiguous().to(device)
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(copies, t, group=process_group)
    ref = copies[reference].cpu().reshape(-1)
    if ref.is_complex():  # compare and index the real and imaginary parts as elements
        ref = torch.view_as_real(ref).reshape(-1)
    ref_bits = _element_bits(ref)
    unequal = torch.zeros(ref.numel(), dtype=torch.bool)
    worst = 0.0
    scales = []
    for r in differ:
        other = copies[r].cpu().reshape(-1)
        if other.is_complex():
            other = torch.view_as_real(other).reshape(-1)
        # Bitwise: NaN-safe, and -0.0 vs 0.0 counts as a difference.
        unequal |= ref_bits.ne(_element_bits(other))
        # Integers are subtracted exactly (2**60 + 1 vs 2**60 is a difference of 1, not 0).
        wide = (
            torch.int64
            if not (ref.is_floating_point() or ref.dtype == torch.bool)
            else torch.float64
        )
        diff = (ref.to(wide) - other.to(wide)).abs()
        if diff.numel():
            worst = max(worst, float(diff.double().nan_to_num(nan=float("inf")).max()))
        scales.append(fitted_scale(other, ref))
    if not unequal.any():
        # What differed a moment ago is equal now: a collective on it was still in flight when
        # the fingerprint was taken (a race), and has landed since. No number to report.
        return Mismatch(
            label, name, differ, reference, None, None, None, None, detail=MOVED, moved=True
        )  # fmt: skip
    first = int(unequal.nonzero()[0])
    shape = tuple(copies[reference].shape)
    if copies[reference].is_complex():
        shape = (*shape, 2)
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), shape)) if shape else ()
    scale = scales[0] if scales and all(_same(c, scales[0]) for c in scales) else None
    # Elements that differ on at least one of the differing ranks.
    return Mismatch(
        label, name, differ, reference, worst, int(unequal.sum()), ref.numel(), index,
        scale=scale,
    )  # fmt: skip


MOVED = (
    "the fingerprints differed, but the values gathered right after are equal on every rank: "
    "they changed between the two reads, so a collective on this tensor was still in flight "
    "(a race: run with --sanitize, the default unless --no-sanitize, to name it)"
)


def fitted_scale(got: torch.Tensor, ref: torch.Tensor, fit: float = SCALE_FIT) -> float | None:
    """c such that `got` is c x `ref` to within `fit` of the larger of max |ref| and max |got|
    everywhere (least squares), or None: when it is not, when either is not floating point,
    or `ref` is all zeros."""
    if not (got.is_floating_point() and ref.is_floating_point()) or got.shape != ref.shape:
        return None
    g, r = got.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    if r.numel() == 0 or not bool(torch.isfinite(g).all() and torch.isfinite(r).all()):
        return None
    if float(r.abs().max()) == 0:
        return None
    size = max(float(r.abs().max()), float(g.abs().max()))
    c = float(g.dot(r) / r.dot(r))
    return c if float((g - c * r).abs().max()) <= fit * size else None


def _same(a: float | None, b: float | None) -> bool:
    """Two fitted factors that are one factor (to the fit's own precision)."""
    return a is not None and b is not None and abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-12)


def common_scale(scales) -> float | None:
    """The one factor every entry of `scales` is (None if any is None or they differ)."""
    scales = list(scales)
    if not scales or any(c is None for c in scales):
        return None
    return scales[0] if all(_same(c, scales[0]) for c in scales) else None


_DIFFER = {"grad": kinds.GRADIENTS_DIFFER, "param": kinds.PARAMETERS_DIFFER,
           "buffer": kinds.BUFFERS_DIFFER, "optim": kinds.STATE_DIFFERS}  # fmt: skip


def measured(found: list[Mismatch], phase: str, step: int) -> tuple[str, dict]:
    """A checkpoint's mismatches as a finding's kind and numbers (`kinds.py`): what differs
    (by the first tensor's prefix), how, and the one factor every differing tensor is of the
    reference rank's, when there is one (`mismatch.py`)."""
    first = found[0]
    prefix = first.tensor.split(":", 1)[0]
    numbers = {
        "step": step, "phase": phase, "tensors": len(found), "how": first.kind,
        "ranks": list(first.ranks), "reference_rank": first.reference_rank,
        "scale": common_scale(m.scale for m in found),
    }  # fmt: skip
    if any(m.moved for m in found):
        return kinds.VALUES_MOVED, numbers
    if phase == "construction":
        return kinds.NOT_BROADCAST, {**numbers, "buffers_only": prefix == "buffer"}
    if prefix == "optim" and first.kind == "absent":
        return kinds.STATE_ON_SOME, numbers
    return _DIFFER.get(prefix, kinds.STATE_DIFFERS), numbers


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _element_bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as same-width integers (complex and bool handled)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_BITS[flat.element_size()])
