"""Exact fingerprints of tensors: one 64-bit integer per tensor, computed where it lives.

A fingerprint is built from the tensor's raw bytes read as integer words (64-bit where the
byte size allows), never from its values as floats: a float sum rounds, so two tensors that
differ in one ULP could sum alike, and a NaN would poison it. Per tensor:

- the wrapping 64-bit sum of its words: a change to any one element changes it (the
  difference of one word is nonzero and below 2**64);
- a position-weighted sum that mixes where each word sits. Tensors of up to 64K words weight
  every word by its own odd 64-bit constant, so values moved between positions and changes
  that cancel exactly are caught too. Larger tensors first sum rows of 256 words (one pass
  over memory, at the speed of a plain sum) and weight each row sum by its row's constant; their
  blind spot is a change confined to one row that keeps that row's sum (a permutation within
  256 words, or changes there that cancel exactly);
- a code for dtype and shape.

The three are mixed (splitmix64) into one integer on the host, after one copy of all the
tensors' sums from the device. Integer addition is associative, so the result does not
depend on threads or reduction order: replicas holding the same bits get the same integer on
every rank, CPU or GPU. Nothing here draws from a random generator or writes to a tensor.
"""

from __future__ import annotations

import hashlib
import zlib

import torch

ROW = 256  # words per row in the position-weighted sum of a large tensor
FULL_WEIGHT_WORDS = 1 << 16  # up to this many words, every word has its own weight
_MASK = (1 << 64) - 1
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """One signed 64-bit fingerprint per tensor (module docstring), in order.

    Small tensors (most of a model's: biases, norms, small layers) are fingerprinted together,
    a handful of operations for all of them, rather than a handful each: their words are
    concatenated per device, weighted by position in the concatenation, and summed per tensor
    as differences of running sums. The ranks compare fingerprints only once they agree on
    the list of tensors (`compare.py`), so a position in the concatenation is the same on
    every rank.
    """
    sums: list[torch.Tensor | None] = [None] * len(tensors)
    small: dict[torch.device, list[int]] = {}
    words = [_as_words(t.detach()) for t in tensors]
    for i, w in enumerate(words):
        if 0 < w.numel() <= FULL_WEIGHT_WORDS:
            small.setdefault(w.device, []).append(i)
        else:
            sums[i] = _sums(w)
    pairs: list[list[int]] = [[0, 0]] * len(tensors)
    for indices in small.values():
        for i, pair in zip(indices, _batched([words[i] for i in indices]).tolist()):
            pairs[i] = pair
    large: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        if s is not None:
            large.setdefault(s.device, []).append(i)
    for indices in large.values():  # one device-to-host copy per device
        for i, pair in zip(indices, torch.stack([sums[i] for i in indices]).tolist()):
            pairs[i] = pair
    return [
        signed(mix(_meta(t) ^ mix(total & _MASK) ^ mix((weighted & _MASK) ^ 0x5BD1E995)))
        for t, (total, weighted) in zip(tensors, pairs)
    ]


def _batched(words: list[torch.Tensor]) -> torch.Tensor:
    """[[word sum, weighted sum]] of each of `words` (small, on one device), together."""
    flat = torch.cat(words)
    ends = torch.tensor([w.numel() for w in words], device=flat.device).cumsum(0) - 1
    weighted = flat * _weights(flat.numel(), flat.device)
    at_ends = torch.stack([flat.cumsum(0)[ends], weighted.cumsum_(0)[ends]], dim=1)
    at_ends[1:] -= at_ends[:-1].clone()  # running sums at each end -> each tensor's own sums
    return at_ends


def value_bits(value: float | int | bool) -> int:
    """A Python number's exact bits as a signed 64-bit integer (a float's IEEE-754 bits), so
    that equal values, and only they, give equal integers; decoded by `bits_value`."""
    import struct

    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def bits_value(bits: int) -> float:
    import struct

    return struct.unpack("<d", struct.pack("<q", bits))[0]


def text_bits(text: str) -> int:
    """A stable 64-bit code of a string (a layout, a non-numeric setting): unlike `hash()`,
    the same in every process."""
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True
    )


def mix(x: int) -> int:
    """splitmix64's finalizer: every input bit affects every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


_META: dict[tuple, int] = {}


def _meta(t: torch.Tensor) -> int:
    key = (t.dtype, t.shape)
    code = _META.get(key)
    if code is None:
        code = _META[key] = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())
    return code


def _sums(words: torch.Tensor) -> torch.Tensor:
    """(word sum, row-weighted sum) of a large tensor's words, int64, on its device."""
    if words.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    full = words.numel() // ROW * ROW
    rows = words[:full].view(-1, ROW).sum(dim=1)
    tail = words[full:].sum()
    weighted = (rows * _weights(rows.numel(), rows.device)).sum() + tail * 0x2545F4914F6CDD1D
    return torch.stack([rows.sum() + tail, weighted])


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as int64 words: 8-byte words where the byte size allows (a view, no copy),
    else 4-, 2- or 1-byte words widened to int64 (a copy, for odd-sized tensors only). The
    width depends on dtype and size alone, never on where the tensor sits in memory."""
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    # The first width that divides the byte size is never narrower than an element.
    _, dtype = next(
        (w, d) for w, d in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
        if nbytes % w == 0
    )  # fmt: skip
    try:
        words = flat.view(dtype)
    except RuntimeError:  # a view at an offset not aligned to the word: copy it first
        words = flat.clone().view(dtype)
    return words if dtype == torch.int64 else words.to(torch.int64)


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """The first n odd 64-bit weights, a fixed formula (no generator), cached per device."""
    cached = _WEIGHTS.get(device)
    if cached is None or cached.numel() < n:
        size = max(n, FULL_WEIGHT_WORDS)
        i = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        w = i * -7046029254386353131 + 0x632BE59BD9B4E019  # wraps: 64-bit integer arithmetic
        cached = (w ^ (w >> 29)) | 1
        _WEIGHTS[device] = cached
    return cached[:n]
