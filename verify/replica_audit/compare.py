"""The replica audit's one comparison and its one `Auditor`: do all ranks hold the same
entries, bitwise? Every audit asks it, through an `Auditor` of its group: a class's
checkpoints (`verify/checks/audit.py`: `ModelAudit`) and a script's audit points
(`verify/script_audit/hooks.py`: `StepHooks`), the drivers that say what is compared and
when. Decided in one all-reduce of fixed size at steady state, per-rank detail gathered only
where the ranks disagree.

1. The header: a digest of the entries' keys, their count and where the ranks are (`where`:
   the optimizer, its step and the point), all-reduced as minimum and maximum (the engine's
   `agree`); from the second time on at the same point, in the same all-reduce as the
   fingerprints (`compare`'s `sizes`). A key is the entry's phase and name, and for a
   tensor with a `typed_key` its dtype and shape (or that it is None) too. Unequal: the
   ranks audit different things (a state entry present on some ranks only, a step skipped
   on one rank, a None gradient); the ranks then gather their headers and each compares
   its keys with the reference rank's, and this is reported as what differs (`layout`),
   never compared further (a size that differs across ranks would crash or hang the next
   collective).
2. The body: one fingerprint per entry (`fingerprint.py`), all-reduced as minimum and
   maximum. Its size is the agreed count, whatever the world size. A tensor whose key has
   no dtype and shape (`typed_key=False`, the class checks') carries them in its
   fingerprint: a None gradient, or a shape that differs, shows here.
3. For every entry whose minimum and maximum differ and that `known` does not cover: every
   rank's fingerprint and dtype-and-shape code (one all-gather), so the ranks that differ
   are named, and a tensor that is None on some ranks or of another dtype or shape is said
   to be. For at most `max_detail` of them (`per_phase` of each phase): a setting's value
   on each rank; a tensor measured, the reference rank's copy broadcast and each rank's
   largest difference, count of differing elements, first differing index and factor
   gathered (`measure.py`). A tensor whose every rank now reads alike changed between the
   two reads (`moved`): a collective on it was still in flight.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verify.replica_audit.finding import TensorDiff
from verify.replica_audit.fingerprint import (
    MISSING,
    bits_value,
    fingerprints,
    meta,
    text_bits,
    value_bits,
)
from verify.replica_audit.group import (
    Group,
    agree,
    broadcast_text,
    gather_ints,
    gather_texts,
    who_differs,
)
from verify.replica_audit.measure import (
    common_scale,
    elements,
    fitted_scale,
    reference_rank,
    unequal,
)

MAX_DETAIL = 12  # tensors per audit point described in full (the rest are counted)
PER_PHASE = 3  # of them, at most this many of one phase: a user reads one of each kind
MAX_BROADCAST_BYTES = 256 << 20  # larger tensors: the ranks that differ, not by how much
_TEXT = 240  # bytes each rank sends to say how its keys differ from the reference's
MOVED = (
    "the fingerprints differed, but the values gathered right after are equal on every rank: "
    "they changed between the two reads, so a collective on this tensor was still in flight "
    "(a race: run with --sanitize, the default unless --no-sanitize, to name it)"
)


@dataclass
class Entry:
    """One thing every rank should hold bitwise alike at one audit point: a tensor (compared
    by its fingerprint) or a setting (a number or a string, compared exactly)."""

    phase: str
    name: str
    tensor: torch.Tensor | None = None  # compared by fingerprint
    setting: float | str | None = None  # compared exactly
    fingerprint: int | None = None  # already computed (a buffer fingerprinted at forward)
    key_extra: str = ""  # dtype and shape of a pre-fingerprinted tensor
    # False: the key is the phase and name only; dtype, shape and None are compared with the
    # values, and a difference is a finding of this tensor (module docstring, step 2)
    typed_key: bool = True

    @property
    def key(self) -> str:
        if not self.typed_key:
            return f"{self.phase}|{self.name}"
        if self.tensor is not None:
            return f"{self.phase}|{self.name}|{self.tensor.dtype}|{tuple(self.tensor.shape)}"
        kind = "setting" if self.setting is not None else self.key_extra or "none"
        return f"{self.phase}|{self.name}|{kind}"


@dataclass
class Outcome:
    """What one audit point found."""

    layout: str = ""  # non-empty: the ranks audit different entries; what differs
    layout_ranks: tuple[int, ...] = ()  # of a layout: the ranks whose entries differ
    mismatched: list[int] = field(default_factory=list)  # indices of entries that differ
    diffs: dict[int, TensorDiff] = field(default_factory=dict)  # detail, by index
    # who differs, for the mismatched entries `known` does not cover and `diffs` does not
    # describe: the ranks, and a None tensor or another dtype or shape; nothing measured
    undescribed: dict[int, TensorDiff] = field(default_factory=dict)
    # this rank's fingerprint of each entry, once the ranks agreed on the layout (else empty):
    # what the audit already computed, for whoever follows the values (`stillness.py`)
    prints: list[int] = field(default_factory=list)
    stop: bool = False  # some rank asked to stop here (`compare`'s `stop`): nothing compared


class Auditor:
    """Compares entries across the ranks of `group` at each audit point (`compare`),
    remembering from one point to the next how many entries the ranks agreed on there (its
    `sizes`: the one all-reduce of steady state). At most `max_detail` differing tensors of a
    point are described in full, `per_phase` of one phase."""

    def __init__(
        self, group: Group, *, max_detail: int = MAX_DETAIL, per_phase: int = PER_PHASE
    ) -> None:
        self.group = group
        self.max_detail, self.per_phase = max_detail, per_phase
        self.sizes: dict = {}  # (optimizer index, point) -> entries the ranks agreed on

    def check(
        self,
        entries: list[Entry],
        where: tuple[int, int, int],
        known: Callable[[Entry], bool] = lambda e: False,
        stop: bool = False,
    ) -> Outcome:
        """`compare` of `entries` at `where` = (optimizer index, step, point) over this
        auditor's group, with its sizes and detail budget."""
        return compare(self.group, entries, where, known=known, sizes=self.sizes,
                       max_detail=self.max_detail, per_phase=self.per_phase, stop=stop)  # fmt: skip


def compare(
    group: Group,
    entries: list[Entry],
    where: tuple[int, int, int],
    known: Callable[[Entry], bool] = lambda e: False,
    sizes: dict | None = None,
    max_detail: int = MAX_DETAIL,
    per_phase: int = PER_PHASE,
    stop: bool = False,
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
    At steady state an audit point is one all-reduce.

    `stop`: this rank cannot go on auditing (its report cannot be written). It rides in the
    header, so the ranks learn in the same all-reduce whether any of them asked: if one did,
    every rank returns `Outcome(stop=True)` here, nothing compared, and the ranks stop
    together rather than one leaving the others in the next collective."""
    keys = [e.key for e in entries]
    header = [text_bits("\n".join(keys)), len(entries), *where, int(stop)]
    sizes = {} if sizes is None else sizes
    expected = sizes.get((where[0], where[2]))
    prints = _fingerprints(entries)
    if expected is None:
        told, same = agree(header, group), None
    else:
        body = (prints + [0] * expected)[:expected]
        both = agree(header + body, group)
        told, same = both[: len(header)], both[len(header) :]
    if stop or not told[-1]:  # a rank asked to stop: every rank sees it, alike
        return Outcome(stop=True)
    agreed = all(told[:-1])
    if not agreed:
        layout, ranks = _layout(group, header, keys)
        return Outcome(layout=layout, layout_ranks=ranks)
    if expected != len(entries):
        sizes[(where[0], where[2])] = len(entries)
        same = agree(prints, group)
    mismatched = [i for i, ok in enumerate(same) if not ok]
    outcome = Outcome(mismatched=mismatched, prints=prints)
    if mismatched:
        told = [i for i in mismatched if not known(entries[i])]
        _detail(group, entries, told, outcome, max_detail=max_detail, per_phase=per_phase)
    return outcome


def _detail(
    group: Group,
    entries: list[Entry],
    told: list[int],
    outcome: Outcome,
    *,
    max_detail: int,
    per_phase: int,
) -> None:
    """Step 3 of the module docstring, for the mismatched entries `told` (indices, the same
    on every rank: a collective): each classified into `outcome.undescribed`, or, for the
    first `max_detail` (`per_phase` of one phase), described into `outcome.diffs`."""
    shown, phases = set(), Counter()
    for i in told:  # the first few of each phase
        if len(shown) < max_detail and phases[entries[i].phase] < per_phase:
            shown.add(i)
            phases[entries[i].phase] += 1
    prints = outcome.prints
    rows = torch.tensor([[prints[i], _meta(entries[i])] for i in told], dtype=torch.int64)
    for i, (ref, ranks, per_rank) in zip(told, who_differs(group, rows.view(-1, 2))):
        diff = _classify(entries[i], ref, ranks, [m for _, m in per_rank])
        if i not in shown:
            outcome.undescribed[i] = diff
        elif diff.how != "values":
            outcome.diffs[i] = diff
        else:
            outcome.diffs[i] = describe(group, entries[i], ref, ranks, [v for v, _ in per_rank])


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


def _meta(entry: Entry) -> int:
    """The dtype-and-shape code of an entry's tensor (`MISSING`: None; 0: a setting)."""
    if entry.tensor is not None:
        return meta(entry.tensor)
    return 0 if entry.setting is not None or entry.fingerprint is not None else MISSING


def _classify(entry: Entry, ref: int, ranks: tuple[int, ...], metas: list[int]) -> TensorDiff:
    """Who differs, and whether in kind (`metas`: every rank's dtype-and-shape code): None
    on some ranks, or another dtype or shape; else values, yet to be measured."""
    missing = [r for r, m in enumerate(metas) if m == MISSING]
    if missing and len(missing) < len(metas):
        s = "s" if len(missing) > 1 else ""
        detail = f"the tensor is None on rank{s} {missing}"
        return TensorDiff(entry.name, ranks, ref, how="missing", detail=detail)
    if len(set(metas)) > 1:
        detail = "dtype or shape differs between ranks"
        return TensorDiff(entry.name, ranks, ref, how="shape", detail=detail)
    return TensorDiff(entry.name, ranks, ref)


def describe(
    group: Group, entry: Entry, ref: int, ranks: tuple[int, ...], per_rank: list[int]
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
    a, b = elements(theirs), elements(mine)
    differ, largest = unequal(a, b)
    if t.is_complex():  # compared part by part; counted by element, as `numel` is
        differ = differ.view(-1, 2).any(dim=1)
    if group.rank not in ranks:  # measured on the ranks whose fingerprints differed only
        differ, largest = torch.zeros_like(differ), 0.0
    # The elements that differ on at least one of them: one reduction of a byte per element.
    union = group.all_reduce_max(differ.to(torch.uint8)).nonzero()
    if union.numel() == 0:  # alike now: it changed between the two reads
        return TensorDiff(entry.name, ranks, ref, detail=MOVED, moved=True)
    scale = fitted_scale(b, a) if bool(differ.any()) else None
    stats = torch.tensor([largest, math.nan if scale is None else scale], dtype=torch.float64)
    rows = [s.tolist() for s in group.gather_tensor(stats)]
    first = torch.unravel_index(union[0, 0], t.shape)
    # the one factor the differing ranks' values are of the reference's, if there is one
    scale = common_scale(None if math.isnan(rows[r][1]) else rows[r][1] for r in ranks)
    return TensorDiff(
        entry.name, ranks, ref, max_abs_diff=max(rows[r][0] for r in ranks),
        differing=union.shape[0], numel=t.numel(), first_index=tuple(int(i) for i in first),
        scale=scale,
    )  # fmt: skip


def _layout(group: Group, header: list[int], keys: list[str]) -> tuple[str, tuple[int, ...]]:
    """What differs between the ranks' entries (module docstring, step 1), and the ranks
    that differ from the reference rank. Never nothing: keys that differ are said to differ
    in which ones, in how many of one, or in their order."""
    headers = gather_ints(group, header)
    ref = reference_rank([h[0] for h in headers])
    parts = []
    steps = {tuple(h[2:]) for h in headers}
    if len(steps) > 1:
        at = ", ".join(f"rank {r}: optimizer {h[2]} step {h[3]}" for r, h in enumerate(headers))
        parts.append(f"the ranks are at different steps ({at})")
    theirs = broadcast_text(group, "\n".join(keys), ref).split("\n")
    said = gather_texts(group, _differs(group.rank, ref, keys, theirs), _TEXT)
    parts += [text for text in said if text]
    parts.append(f"(compared with rank {ref}'s {len(theirs)} entries)")
    off = {r for r, h in enumerate(headers) if h[2:] != headers[ref][2:]}
    ranks = tuple(sorted(off | {r for r, text in enumerate(said) if text}))
    return "; ".join(parts), ranks


def _differs(rank: int, ref: int, keys: list[str], theirs: list[str]) -> str:
    """How this rank's `keys` differ from rank `ref`'s (`theirs`), or "" where they do not."""
    if keys == theirs:
        return ""
    have, want = set(keys), set(theirs)
    missing = [k for k in theirs if k not in have]
    extra = [k for k in keys if k not in want]
    if missing or extra:
        return f"rank {rank}: " + "; ".join(
            f"{label} {len(ks)} ({', '.join(_short(k) for k in ks[:3])})"
            for label, ks in (("lacks", missing), ("has extra", extra)) if ks
        )  # fmt: skip
    mine, ours = Counter(keys), Counter(theirs)
    if mine != ours:  # the same keys, some of them repeated
        odd = [k for k in dict.fromkeys(keys) if mine[k] != ours[k]]
        return f"rank {rank}: " + ", ".join(
            f"{_short(k)} {mine[k]} times where rank {ref} has it {ours[k]}" for k in odd[:3]
        )
    at = next(i for i, (a, b) in enumerate(zip(keys, theirs)) if a != b)
    return (
        f"rank {rank}: the same {len(keys)} entries in another order (entry {at} is "
        f"{_short(keys[at])} where rank {ref}'s is {_short(theirs[at])})"
    )


def _short(key: str) -> str:
    """A key as a user reads it: the name, without the phase and dtype."""
    parts = key.split("|")
    return parts[1] if len(parts) > 1 else key
