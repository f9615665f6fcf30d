"""A fixed-size numeric sketch of a tensor: what a recording keeps of it besides its bitwise
fingerprint (`verify/replica_audit/fingerprint.py`, the engine's one fingerprint).

The fingerprint answers "bitwise equal?"; the sketch answers "how close, and where?" when the
two runs cannot be bitwise equal. Its size does not depend on the tensor's: the flattened
tensor is cut into `BLOCKS` contiguous blocks of ceil(n / BLOCKS) elements (fewer blocks when
the tensor has fewer elements), and each block keeps two numbers, in float32:

    sum        its elements' sum
    norm       its L2 norm

The whole tensor's sum and norm follow from its blocks (in float64, `totals`); its count is
kept beside the sketch. A block's largest |element| is not kept: on the CPU it costs as much
again as the sum and the norm together (two more passes over memory, amax and amin), and the
sketch is what the recording costs a step (benchmarks/record_cost.py); the norm already
bounds it. From two sketches of tensors A and B, for each block,

    |norm(A_b) - norm(B_b)| <= ||A_b - B_b||        (triangle inequality)
    |sum(A_b) - sum(B_b)|   <= sqrt(n_b) ||A_b - B_b||   (Cauchy-Schwarz)

so `gaps` gives a lower bound on each block's relative L2 difference: a sketch never makes
two tensors look further apart than they are, and the block with the largest bound is where
the difference is said to be. What a sketch cannot see (a change that keeps every block's
sum and norm, a permutation within a block) only the fingerprint catches, and does, in the
bitwise comparison.

Reads tensors, never writes one, and draws from no random generator.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BLOCKS = 16  # blocks per tensor: 16 x 2 float32 = 128 bytes, whatever the tensor's size
SUM, NORM = 0, 1  # the columns of a block row
COLUMNS = 2


def sketch(tensor: torch.Tensor) -> np.ndarray:
    """The [BLOCKS, COLUMNS] float32 sketch of `tensor` (module docstring); unused blocks are zero.
    Its element count is kept beside it (the recording's `numel`): block b holds elements
    [b * size, (b + 1) * size) of the flattened tensor, size = ceil(numel / BLOCKS)."""
    out = np.zeros((BLOCKS, COLUMNS), dtype=np.float32)
    used = blocks_used(sketched_numel(tensor))
    if used:
        out[:used] = block_rows(tensor, 0, used).cpu().numpy()
    return out


def block_rows(tensor: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Rows `first` to `end - 1` of `tensor`'s sketch, a [end - first, COLUMNS] float32 tensor
    on its device (`first < end <= blocks_used`): what a rank sharing the sketching computes
    of the tensor (`shares.py`), the same bits as those rows of `sketch(tensor)`.

    A block's two numbers are one row of a row-wise reduction over the [blocks, size] view,
    and ATen reduces each row alone, in the same order, however many rows the view holds,
    except one row alone on several threads (it then splits the row between them). So a
    single full block is reduced with a neighbour, dropped after; the last, shorter block is
    always reduced alone, here as in `sketch`."""
    x = _flat(tensor)
    n = x.numel()
    size = block_size(n)
    full = n // size
    rows = []
    low, high = first, min(end, full)
    if low < high:
        pad = high - low == 1 and full > 1  # one full block: reduce two (docstring)
        start = low - 1 if pad and high == full else low
        stop = max(high, start + 2) if pad else high
        both = _reduce(x[start * size : stop * size].view(-1, size))
        rows.append(both[low - start : high - start])
    if end > full:  # the last, shorter block
        rows.append(_reduce(x[full * size :].view(1, -1)))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def sketched_numel(tensor: torch.Tensor) -> int:
    """The elements a sketch of `tensor` is taken over: its numel, twice that when complex
    (real and imaginary parts, `torch.view_as_real`)."""
    return tensor.numel() * (2 if tensor.is_complex() else 1)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    x = tensor.detach().reshape(-1)
    if x.is_complex():
        return torch.view_as_real(x).reshape(-1)
    if not x.is_floating_point():
        return x.double()  # integer counters (an optimizer's step, num_batches_tracked), bools
    return x


def _reduce(blocks: torch.Tensor) -> torch.Tensor:
    """[rows, 2]: each row's sum and L2 norm, in float32: two passes over memory, no
    temporary as large as the tensor (a float32 accumulator for 16-bit inputs)."""
    wide = blocks.dtype if blocks.dtype in (torch.float32, torch.float64) else torch.float32
    sums = blocks.sum(dim=1, dtype=wide)
    return torch.stack([sums, torch.linalg.vector_norm(blocks, dim=1, dtype=wide)], 1).float()


def block_size(numel: int) -> int:
    """Elements per block of a tensor of `numel` elements (the last block may be shorter)."""
    return max(1, -(-numel // BLOCKS))


def blocks_used(numel: int) -> int:
    """How many of the BLOCKS blocks hold elements (all of them from 226 elements on)."""
    return -(-numel // block_size(numel)) if numel else 0


def block_counts(numel: int) -> np.ndarray:
    """How many elements each of the BLOCKS blocks holds (0 for unused ones)."""
    size = block_size(numel)
    starts = np.arange(BLOCKS, dtype=np.int64) * size
    return np.clip(numel - starts, 0, size)


def totals(blocks: np.ndarray) -> tuple[float, float]:
    """(sum, L2 norm) of the whole tensor, from its blocks, in float64."""
    b = blocks.astype(np.float64)
    return float(b[:, SUM].sum()), float(np.sqrt((b[:, NORM] ** 2).sum()))


def gaps(a: np.ndarray, b: np.ndarray, numel: int) -> np.ndarray:
    """Per block, a lower bound on ||A_b - B_b|| / scale_b (module docstring), where scale_b
    is the larger of the two blocks' norms, floored at the tensor's norm shared evenly over
    its blocks (a block of tiny values is not judged by its own rounding alone). Two blocks
    that are both non-finite the same way are 0 apart; one non-finite, infinitely."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    counts = block_counts(numel).astype(np.float64)
    used = counts > 0
    d_norm = np.abs(a64[:, NORM] - b64[:, NORM])
    d_sum = np.abs(a64[:, SUM] - b64[:, SUM]) / np.sqrt(np.maximum(counts, 1))
    bound = np.maximum(d_norm, d_sum)
    whole = max(totals(a)[1], totals(b)[1])
    floor = whole / math.sqrt(max(int(used.sum()), 1))
    scale = np.maximum(np.maximum(a64[:, NORM], b64[:, NORM]), floor)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(scale > 0, bound / scale, np.where(bound > 0, np.inf, 0.0))
    finite_a, finite_b = np.isfinite(a64).all(axis=1), np.isfinite(b64).all(axis=1)
    same_bad = ~finite_a & ~finite_b & (np.isnan(a64) == np.isnan(b64)).all(axis=1)
    out = np.where(same_bad, 0.0, np.where(finite_a & finite_b, out, np.inf))
    return np.where(used, out, 0.0)
