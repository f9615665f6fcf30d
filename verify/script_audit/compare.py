"""One audit point: do all ranks hold the same entries, bitwise? Decided in two all-reduces
of fixed size, per-rank detail gathered only where they do not.

1. The header: a digest of the entries' keys (names, dtypes, shapes), their count, the
   optimizer, its step and the point (before or after the step): 5 words, all-reduced as
   maximum and minimum (the engine's `agree`); from the second time on at the same point, in
   the same all-reduce as the fingerprints (`compare`'s `sizes`). Unequal: the ranks audit different things (a
   state entry present on some ranks only, a step skipped on one rank); the ranks then
   gather their headers and each compares its keys with the reference rank's, and this is
   reported as what differs, never compared further (a size that differs across ranks
   would crash or hang the next collective).
2. The body: one fingerprint per entry, all-reduced as maximum and minimum. Its size is the
   agreed count, whatever the world size.
3. Only for entries whose minimum and maximum differ (at most `MAX_DETAIL` of them): every
   rank's fingerprint (an all-gather), so the ranks that differ are named; for a setting, its
   value on each rank; for a tensor, the reference rank's copy broadcast and each rank's
   largest difference, count of differing elements and first differing index gathered.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verify.replica_audit.finding import TensorDiff
from verify.replica_audit.fingerprint import bits_value, fingerprints, text_bits, value_bits
from verify.replica_audit.group import agree, who_differs
from verify.replica_audit.measure import (
    common_scale,
    elements,
    fitted_scale,
    reference_rank,
    unequal,
)
from verify.script_audit.collect import Entry
from verify.script_audit.side_group import SideGroup

MAX_DETAIL = 12  # tensors per audit point described in full (the rest are counted)
MAX_BROADCAST_BYTES = 256 << 20  # larger tensors: the ranks that differ, not by how much
_TEXT = 240  # bytes each rank sends to say how its keys differ from the reference's


@dataclass
class Outcome:
    """What one audit point found."""

    layout: str = ""  # non-empty: the ranks audit different entries; what differs
    mismatched: list[int] = field(default_factory=list)  # indices of entries that differ
    diffs: dict[int, TensorDiff] = field(default_factory=dict)  # detail, by index


def compare(
    group: SideGroup,
    entries: list[Entry],
    where: tuple[int, int, int],
    known: Callable[[Entry], bool] = lambda e: False,
    sizes: dict | None = None,
) -> Outcome:
    """Compare `entries` across ranks (module docstring); `where` = (optimizer index, step,
    point), which every rank must share. Entries for which `known` is true (a divergence
    already reported, seen again) are not described again; `known` must answer alike on
    every rank (it reads what the ranks agreed on).

    `sizes` (kept by the caller from one audit point to the next) remembers how many entries
    the ranks agreed on at this optimizer's point before: the header and the fingerprints
    then travel in one all-reduce, the fingerprints padded or cut to that agreed size, and
    are used only if the header agrees and its count is that size (what every rank decides
    alike, from agreed values); otherwise a second all-reduce sends them at the agreed count.
    At steady state an audit point is one all-reduce."""
    keys = [e.key for e in entries]
    header = [text_bits("\n".join(keys)), len(entries), *where]
    sizes = {} if sizes is None else sizes
    expected = sizes.get((where[0], where[2]))
    prints = _fingerprints(entries)
    if expected is None:
        agreed, same = all(agree(header, group)), None
    else:
        body = (prints + [0] * expected)[:expected]
        both = agree(header + body, group)
        agreed, same = all(both[: len(header)]), both[len(header) :]
    if not agreed:
        return Outcome(layout=_layout(group, header, keys))
    if expected != len(entries):
        sizes[(where[0], where[2])] = len(entries)
        same = agree(prints, group)
    mismatched = [i for i, ok in enumerate(same) if not ok]
    outcome = Outcome(mismatched=mismatched)
    if not mismatched:
        return outcome
    shown, per_phase = [], Counter()
    for i in mismatched:  # the first few of each phase: a user reads one of each kind
        if len(shown) < MAX_DETAIL and per_phase[entries[i].phase] < 3 and not known(entries[i]):
            shown.append(i)
            per_phase[entries[i].phase] += 1
    if not shown:
        return outcome
    seen = who_differs(group, torch.tensor([[prints[i]] for i in shown]))
    for i, (ref, ranks, per_rank) in zip(shown, seen):
        outcome.diffs[i] = _describe(group, entries[i], ref, ranks, [v for (v,) in per_rank])
    return outcome


def _fingerprints(entries: list[Entry]) -> list[int]:
    # An entry's own fingerprint, when it has one, was computed already by the same function
    # (a buffer at DDP's forward; a tensor that `audit --record` fingerprinted as it sketched it).
    tensors = [e.tensor for e in entries if e.tensor is not None and e.fingerprint is None]
    computed = iter(fingerprints(tensors))
    out = []
    for e in entries:
        if e.fingerprint is not None:
            out.append(e.fingerprint)
        elif e.tensor is not None:
            out.append(next(computed))
        elif isinstance(e.setting, float):
            out.append(value_bits(e.setting))
        elif isinstance(e.setting, str):
            out.append(text_bits(e.setting))
        else:
            out.append(0)  # no tensor on any rank (its key says so on every rank)
    return out


def _describe(
    group: SideGroup, entry: Entry, ref: int, ranks: tuple[int, ...], per_rank: list[int]
) -> TensorDiff:
    """How `entry` differs on `ranks` from rank `ref`'s (`per_rank`: every rank's
    fingerprint): a setting's value on each rank, or a tensor measured."""
    diff = TensorDiff(entry.name, ranks, ref)
    if isinstance(entry.setting, float):
        shown = dict.fromkeys([ref, *ranks][:8])
        values = tuple(f"rank {r}: {bits_value(per_rank[r]):.6g}" for r in shown)
        return TensorDiff(entry.name, ranks, ref, values=values)
    t = entry.tensor
    if t is None or t.numel() * t.element_size() > MAX_BROADCAST_BYTES:
        return diff
    mine = t.detach().to("cpu", copy=True).contiguous()
    theirs = group.broadcast(mine.clone(), ref)
    stats = torch.tensor(_stats(theirs, mine), dtype=torch.float64)
    rows = [s.tolist() for s in group.gather_tensor(stats)]
    worst = max((r for r in ranks), key=lambda r: (rows[r][0], rows[r][1]), default=ref)
    max_abs, differing, first, _ = rows[worst]
    index = None if first < 0 else tuple(torch.unravel_index(torch.tensor(int(first)), t.shape))
    # the one factor the differing ranks' values are of the reference's, if there is one
    scale = common_scale(None if math.isnan(rows[r][3]) else rows[r][3] for r in ranks)
    return TensorDiff(
        entry.name, ranks, ref, max_abs_diff=max(r[0] for r in rows), differing=int(differing),
        numel=t.numel(), first_index=None if index is None else tuple(int(i) for i in index),
        scale=scale,
    )  # fmt: skip


def _stats(ref: torch.Tensor, mine: torch.Tensor) -> list[float]:
    """[largest |mine - ref| where they differ, elements that differ, flat index of the first
    (-1: none), the factor mine is of ref (NaN: none)], compared bitwise (`measure.py`)."""
    a, b = elements(ref), elements(mine)
    differ, largest = unequal(a, b)
    if ref.is_complex():  # compared part by part; counted by element, as `numel` is
        differ = differ.view(-1, 2).any(dim=1)
    count = int(differ.sum())
    first = int(differ.nonzero()[0, 0]) if count else -1
    scale = fitted_scale(b, a) if count else None
    return [largest, float(count), float(first), math.nan if scale is None else scale]


def _layout(group: SideGroup, header: list[int], keys: list[str]) -> str:
    """What differs between the ranks' entries (module docstring, step 1)."""
    headers = group.gather(header)
    ref = reference_rank([h[0] for h in headers])
    parts = []
    steps = {tuple(h[2:]) for h in headers}
    if len(steps) > 1:
        at = ", ".join(f"rank {r}: optimizer {h[2]} step {h[3]}" for r, h in enumerate(headers))
        parts.append(f"the ranks are at different steps ({at})")
    theirs = group.broadcast_text("\n".join(keys), ref).split("\n")
    have, want = set(keys), set(theirs)
    missing = [k for k in theirs if k not in have]
    extra = [k for k in keys if k not in want]
    mine = ""
    if missing or extra:
        mine = f"rank {group.rank}: " + "; ".join(
            f"{label} {len(ks)} ({', '.join(_short(k) for k in ks[:3])})"
            for label, ks in (("lacks", missing), ("has extra", extra)) if ks
        )  # fmt: skip
    data = fit(mine, _TEXT).encode().ljust(_TEXT, b"\0")
    texts = group.gather_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    for t in texts:
        text = bytes(t.tolist()).rstrip(b"\0").decode(errors="replace")
        if text:
            parts.append(text)
    parts.append(f"(compared with rank {ref}'s {len(theirs)} entries)")
    return "; ".join(parts)


def _short(key: str) -> str:
    """A key as a user reads it: the name, without the phase and dtype."""
    parts = key.split("|")
    return parts[1] if len(parts) > 1 else key


def fit(text: str, limit: int) -> str:
    """`text` cut to at most `limit` bytes of UTF-8 at a separator (", " or "; "), never
    mid-name, with ", ..." where it was cut."""
    if len(text.encode()) <= limit:
        return text
    cut = text.encode()[: limit - 5].decode(errors="ignore")
    at = max(cut.rfind(", "), cut.rfind("; "))
    return (cut[:at] if at > 0 else cut) + ", ..."
