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
_LAYOUTS: dict[tuple, torch.Tensor] = {}  # (device, piece sizes) -> weights, in use order


def fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """One signed 64-bit fingerprint per tensor (module docstring), in order.

    All tensors of a device are fingerprinted together, a handful of operations for all of
    them rather than a handful each: a small tensor's words, and a large tensor's row sums
    and left-over words, are concatenated, weighted by position in the concatenation, and
    summed per piece as differences of running sums. The ranks compare fingerprints only once
    they agree on the list of tensors (`compare.py`), so a position in the concatenation is
    the same on every rank.
    """
    pieces: dict[torch.device, list[torch.Tensor]] = {}
    owners: dict[torch.device, list[int]] = {}  # the tensor each piece belongs to
    for i, t in enumerate(tensors):
        words = _as_words(t.detach())
        if words.numel() > FULL_WEIGHT_WORDS:
            full = words.numel() // ROW * ROW
            parts = [words[:full].view(-1, ROW).sum(dim=1)]  # one pass, at memory speed
            if full < words.numel():
                parts.append(words[full:])
        else:
            parts = [words] if words.numel() else []
        pieces.setdefault(words.device, []).extend(parts)
        owners.setdefault(words.device, []).extend([i] * len(parts))
    totals, weighted = [0] * len(tensors), [0] * len(tensors)
    for device, parts in pieces.items():
        if not parts:
            continue
        for i, (total, weight) in zip(owners[device], _batched(parts).tolist()):  # one copy
            totals[i] += total
            weighted[i] += weight
    return [
        signed(mix(_meta(t) ^ mix(total & _MASK) ^ mix((weight & _MASK) ^ 0x5BD1E995)))
        for t, total, weight in zip(tensors, totals, weighted)
    ]


def _batched(words: list[torch.Tensor]) -> torch.Tensor:
    """[[word sum, weighted sum]] of each of `words` (non-empty, on one device), together."""
    flat = torch.cat(words)
    sizes = tuple(w.numel() for w in words)
    ends = torch.tensor(sizes, device=flat.device).cumsum(0) - 1
    weighted = flat * _piece_weights(sizes, flat.device)
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


def _piece_weights(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The weights of a concatenation of pieces of these sizes: each piece weighted from the
    first weight on, so a tensor's fingerprint does not depend on its neighbours. Built once
    per layout (the pieces of an audit point are the same from one step to the next) and
    kept for the last few layouts."""
    key = (device, sizes)
    cached = _LAYOUTS.pop(key, None)
    if cached is None:
        longest = _weights(max(sizes), device)
        cached = torch.cat([longest[:n] for n in sizes])
    _LAYOUTS[key] = cached  # most recent last
    while len(_LAYOUTS) > 8:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    return cached


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
