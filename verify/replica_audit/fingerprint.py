"""Exact fingerprints of tensors, computed where they live: the one fingerprint of the replica
audit (its comparison, for a class's checks and a script's audit; the reference's digests).

A fingerprint is built from the tensor's raw bytes read as integer words (64-bit where the
byte size allows), never from its values as floats: a float sum rounds, so two tensors that
differ in one ULP could sum alike, and a NaN would poison it. Per tensor, three int64 values:

- a code for dtype and shape (`MISSING` for a tensor a rank does not hold, a `.grad` that is
  None);
- the wrapping 64-bit sum of its words: a change to any one element changes it (the
  difference of one word is nonzero and below 2**64), so one ULP anywhere is caught;
- a position-weighted sum that mixes where each word sits. Tensors of up to 64K words weight
  every word by its own odd 64-bit constant, so values moved between positions and changes
  that cancel exactly are caught too. Larger tensors first sum rows of 256 words (one pass
  over memory, at the speed of a plain sum) and weight each row sum by its row's own odd
  constant (not by the row's index, under which changes to three rows of +d, -2d, +d would
  cancel); their blind spot is a change confined to one row that keeps that row's sum (a
  permutation within 256 words, or changes there that cancel exactly).

`fingerprint_table` gives the three values of many tensors as one int64 table on the device
the caller names, with one copy per device the tensors live on; `fingerprints` mixes each
row into one integer (splitmix64) on the host, for audits that compare one word per tensor.
Integer addition is associative, so neither depends on threads or reduction order: replicas
holding the same bits get the same values on every rank, CPU or GPU. Nothing here draws from
a random generator or writes to a tensor it was given.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable

import torch

ROW = 256  # words per row in the position-weighted sum of a large tensor
FULL_WEIGHT_WORDS = 1 << 16  # up to this many words, every word has its own weight
MISSING = -1  # the dtype-and-shape code of a tensor a rank does not hold (a None grad)
_MASK = (1 << 64) - 1
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_LAYOUTS: dict[tuple, torch.Tensor] = {}  # (device, piece sizes) -> weights, in use order
_META: dict[tuple, int] = {}


def fingerprint(tensor: torch.Tensor | None) -> torch.Tensor:
    """Three int64 values identifying `tensor` bitwise: (dtype-and-shape code, word sum,
    weighted sum), on the tensor's device, without a host sync (on the CPU for None)."""
    device = tensor.device if tensor is not None else torch.device("cpu")
    return fingerprint_table([tensor], device)[0]


def fingerprint_table(
    tensors: list[torch.Tensor | None],
    device: torch.device,
    each: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The fingerprints of `tensors` (module docstring), a [len(tensors), 3] int64 table on
    `device`.

    All tensors of a device are fingerprinted together, a handful of operations for all of
    them rather than a handful each: a small tensor's words, and a large tensor's row sums
    and left-over words, are concatenated, weighted by position within their own piece, and
    summed per piece as differences of running sums; each device's sums travel to `device`
    in one copy.

    `each(i)`, when given, is called once tensor i's words were read (its one pass over
    memory), in order: a caller that reads the tensor too (`audit --record`'s sketch) reads
    it there, from the cache, rather than from memory a second time.
    """
    pieces: dict[torch.device, list[torch.Tensor]] = {}
    owners: dict[torch.device, list[int]] = {}  # the tensor each piece belongs to
    for i, t in enumerate(tensors):
        if t is None:
            continue
        parts = _pieces(_as_words(t.detach()))
        pieces.setdefault(t.device, []).extend(parts)
        owners.setdefault(t.device, []).extend([i] * len(parts))
        if each is not None:
            each(i)
    codes = [MISSING if t is None else meta(t) for t in tensors]
    table = torch.zeros(len(tensors), 3, dtype=torch.int64, device=device)
    table[:, 0] = torch.tensor(codes, dtype=torch.int64).to(device)
    for on, parts in pieces.items():
        if not parts:
            continue
        index = torch.tensor(owners[on], dtype=torch.int64).to(device)
        table[:, 1:].index_add_(0, index, _batched(parts).to(device))  # wraps, like the sums
    return table


def fingerprints(
    tensors: list[torch.Tensor], each: Callable[[int], None] | None = None
) -> list[int]:
    """One signed 64-bit fingerprint per tensor, in order: its three values (module
    docstring) mixed into one on the host, after one copy per device (`each`: as
    `fingerprint_table`'s)."""
    rows = fingerprint_table(tensors, torch.device("cpu"), each).tolist()
    return [mixed(code, total, weight) for code, total, weight in rows]


def mixed(code: int, total: int, weight: int) -> int:
    """One row of `fingerprint_table` mixed into one signed 64-bit fingerprint."""
    return signed(mix(code ^ mix(total & _MASK) ^ mix((weight & _MASK) ^ 0x5BD1E995)))


def _pieces(words: torch.Tensor) -> list[torch.Tensor]:
    """The int64 pieces whose weighted sums make up a tensor's: its words (small), or its
    row sums and left-over words (large). Narrow words are widened only after the row sum,
    so a large tensor is read once and never copied wider."""
    if words.numel() == 0:
        return []
    if words.numel() <= FULL_WEIGHT_WORDS:
        return [words.to(torch.int64)]
    full = words.numel() // ROW * ROW
    parts = [words[:full].view(-1, ROW).sum(dim=1, dtype=torch.int64)]  # one pass over memory
    if full < words.numel():
        parts.append(words[full:].to(torch.int64))
    return parts


def _batched(words: list[torch.Tensor]) -> torch.Tensor:
    """[[word sum, weighted sum]] of each of `words` (non-empty, int64, on one device)."""
    flat = torch.cat(words)
    sizes = tuple(w.numel() for w in words)
    ends = torch.tensor(sizes, device=flat.device).cumsum(0) - 1
    weighted = flat * _piece_weights(sizes, flat.device)
    at_ends = torch.stack([flat.cumsum(0)[ends], weighted.cumsum_(0)[ends]], dim=1)
    at_ends[1:] -= at_ends[:-1].clone()  # running sums at each end -> each piece's own sums
    return at_ends


def value_bits(value: float | int | bool) -> int:
    """A Python number's exact bits as a signed 64-bit integer (a float's IEEE-754 bits), so
    that equal values, and only they, give equal integers; decoded by `bits_value`."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def bits_value(bits: int) -> float:
    """The float whose bits `value_bits` gave."""
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
    """`x` read as a two's-complement 64-bit integer."""
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def meta(t: torch.Tensor) -> int:
    """The code for `t`'s dtype and shape: a fingerprint's first value."""
    key = (t.dtype, t.shape)
    code = _META.get(key)
    if code is None:
        code = _META[key] = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())
    return code


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as integer words: 8-byte words where the byte size allows, else 4-, 2- or
    1-byte words (a view, no copy, unless the tensor is not contiguous or sits at an offset
    not aligned to the word). The width depends on dtype and size alone, never on where the
    tensor sits in memory."""
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    # The first width that divides the byte size is never narrower than an element.
    dtype = next(
        d for w, d in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
        if nbytes % w == 0
    )  # fmt: skip
    try:
        return flat.view(dtype)
    except RuntimeError:  # a view at an offset not aligned to the word: copy it first
        return flat.clone().view(dtype)


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
