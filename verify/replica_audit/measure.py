"""How one tensor differs from the reference rank's copy: the one measure of every audit, once
its fingerprints disagreed (`compare.py`, on the reference rank's copy broadcast to each
rank).

Elements are compared bitwise, as the fingerprints are: a NaN equals a NaN with the same bits,
and -0.0 differs from 0.0. The largest difference is taken over the differing elements (an
infinite one where either is NaN); integers are subtracted exactly. Complex tensors are
compared part by part (real, imaginary). Besides where and by how much, it measures whether
the differing copy is the reference times one factor (`fitted_scale`): a gradient clipped, or
loss-scaled, on some ranks only is exactly that, with the same factor in every tensor
(`hint_rules.gradients_differ`).

Imports only torch: a script's rank measures with it.
"""

from __future__ import annotations

import torch

# A multiple to rounding: a factor applied in float32 leaves each element within ~1e-7 of
# c x reference (relative to max |reference|); a tensor that is no multiple is off by its own
# scale. 1e-5 sits between, far from both.
SCALE_FIT = 1e-5

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def elements(t: torch.Tensor) -> torch.Tensor:
    """`t` flat, on the CPU, a complex tensor as its real and imaginary parts."""
    flat = t.detach().cpu().reshape(-1)
    return torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat


def unequal(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Of two flat tensors of one dtype and size (`elements`): which elements differ bitwise,
    and the largest |difference| among them (0.0 when none; inf where either is NaN)."""
    differ = _bits(ref).ne(_bits(other))
    if not bool(differ.any()):
        return differ, 0.0
    wide = torch.float64 if ref.is_floating_point() or ref.dtype == torch.bool else torch.int64
    gap = (ref[differ].to(wide) - other[differ].to(wide)).abs()
    return differ, float(gap.double().nan_to_num(nan=float("inf")).max())


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


def common_scale(scales) -> float | None:
    """The one factor every entry of `scales` is (None if any is None or they differ)."""
    scales = list(scales)
    if not scales or any(c is None for c in scales):
        return None
    return scales[0] if all(_same(c, scales[0]) for c in scales) else None


def reference_rank(per_rank: list) -> int:
    """The rank holding the value most ranks hold (the lowest such rank on a tie)."""
    counts = {v: per_rank.count(v) for v in per_rank}
    return max(range(len(per_rank)), key=lambda r: (counts[per_rank[r]], -r))


def _same(a: float | None, b: float | None) -> bool:
    """Two fitted factors that are one factor (to the fit's own precision)."""
    return a is not None and b is not None and abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-12)


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """A flat tensor's elements as same-width integers (bool as bytes)."""
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    return flat.contiguous().view(_BITS[flat.element_size()])
