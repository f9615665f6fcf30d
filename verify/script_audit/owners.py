"""Who holds each parameter's optimizer state: every rank (replicated: compared bitwise), one
rank (sharded by design: counted, never compared), or something in between (a fault).

Not every optimizer keeps its state on every rank. modded-nanogpt's Muon keeps each matrix's
momentum on its owner rank only (`i % world_size == rank`), orthogonalizes the owner's update
and all-reduces the updates, so every rank applies all of them; the parameters stay bitwise
alike while the state is split between the ranks. That is sharded by design, as
ZeroRedundancyOptimizer's and FSDP2's state is. The line between a design and a fault, per
parameter of the optimizer (they are the same on every rank: the parameters after the step
were just agreed):

    nobody holds state for it          nothing to compare
    every rank holds the same entries  replicated: the entries are compared bitwise
    exactly one rank holds any         sharded by design: counted, not compared (what it
                                       computes shows in the parameters, compared every step)
    anything else                      a fault: state lost or reset on some ranks (an entry
                                       held by some ranks and missing on others that hold
                                       its siblings), or computed on several ranks but not
                                       all (an owner test that two ranks pass, which also
                                       applies that update twice)

Decided in one all-reduce whose size grows with the parameters, never with the world size:
per parameter, whether this rank holds state, its rank when it does (the maximum and minimum
over the holders say whether there is one), a digest of the entries' keys (names, dtypes,
shapes; equal minimum and maximum over the holders: they hold the same entries) and how many
entries it holds. Which ranks hold what is gathered only after a fault, for the first
`MAX_DETAIL` parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verify.replica_audit.compare import Entry
from verify.replica_audit.fingerprint import text_bits
from verify.replica_audit.group import broadcast_text, gather_ints, gather_texts
from verify.script_audit.side_group import SideGroup

MAX_DETAIL = 3  # parameters whose holders are described after a fault
_TEXT = 240  # bytes each rank sends to say how its entries differ from the first holder's
_LOW, _HIGH = -(1 << 63), (1 << 63) - 1  # neutral for a maximum, for a minimum


@dataclass
class Holdings:
    """What one state point's ownership reduction decided (module docstring)."""

    replicated: list[Entry] = field(default_factory=list)  # to compare bitwise
    sharded: int = 0  # entries held by exactly one rank, summed over the parameters
    problem: str = ""  # non-empty: the fault, in words


def split(group: SideGroup, names: list[str], per_param: list[list[Entry]]) -> Holdings:
    """Sort this rank's state entries, one list per parameter (`names`, the same parameters
    in the same order on every rank), into replicated and sharded (module docstring). A
    collective: every rank of `group` calls it at the same point."""
    holds = [1 if entries else 0 for entries in per_param]
    digests = [text_bits("\n".join(e.key for e in entries)) for entries in per_param]
    me = group.rank
    mine = []  # per parameter: the values whose maxima the ranks share
    for h, d, entries in zip(holds, digests, per_param):
        mine += [h, ~h, me if h else -1, ~(me if h else group.size),
                 d if h else _LOW, ~(d if h else _HIGH), len(entries)]  # fmt: skip
    reduced = group.max(mine)
    out, bad = Holdings(), []
    for i, entries in enumerate(per_param):
        anyone, every, highest, lowest, dmax, dmin, count = reduced[7 * i : 7 * i + 7]
        every, lowest, dmin = ~every, ~lowest, ~dmin  # the minima
        if not anyone:
            continue
        if every and dmax == dmin:
            out.replicated += entries
        elif highest == lowest:
            out.sharded += count
        else:
            bad.append((i, lowest))
    if bad:
        out.problem = _describe(group, names, per_param, bad)
    return out


def _describe(group: SideGroup, names: list[str], per_param: list[list[Entry]], bad) -> str:
    """Which ranks hold what, for the first few parameters at fault: each rank compares its
    entries with the lowest holder's and says how they differ (per-rank detail, after the
    fault only)."""
    parts = []
    for i, ref in bad[:MAX_DETAIL]:
        keys = [_short(e.name, names[i]) for e in per_param[i]]
        theirs = broadcast_text(group, "\n".join(keys), ref).split("\n")
        holders = [r for r, h in enumerate(gather_ints(group, [1 if keys else 0])) if h[0]]
        mine = ""
        if not keys:
            mine = f"rank {group.rank} holds none of it"
        elif keys != theirs:
            lacks = [k for k in theirs if k not in keys]
            extra = [k for k in keys if k not in theirs]
            mine = f"rank {group.rank} " + " and ".join(
                f"{verb} {', '.join(ks)}" for verb, ks in (("lacks", lacks), ("has extra", extra))
                if ks
            )  # fmt: skip
        # The same entry names everywhere, yet the digests differ: a dtype or a shape does.
        forms = [_form(e, names[i]) for e in per_param[i]]
        ref_forms = broadcast_text(group, "\n".join(forms), ref).split("\n")
        if keys and keys == theirs and forms != ref_forms:
            odd = [f for f, r in zip(forms, ref_forms) if f != r]
            mine = f"rank {group.rank} holds {', '.join(odd)} where rank {ref} holds " + ", ".join(
                r for f, r in zip(forms, ref_forms) if f != r
            )
        said = gather_texts(group, mine, _TEXT)
        who = ", ".join(map(str, holders))
        parts.append(f"{names[i]}'s state ({', '.join(theirs)}) is held by rank"
                     f"{'s' if len(holders) > 1 else ''} {who}: "
                     + "; ".join(s for s in said if s))  # fmt: skip
    more = f"; and {len(bad) - MAX_DETAIL} more parameters" if len(bad) > MAX_DETAIL else ""
    return (
        "optimizer state held by some ranks only: " + "; ".join(parts) + more
        + " (state sharded by design is held by exactly one rank, replicated state by every "
        "rank alike)"
    )  # fmt: skip


def _form(entry: Entry, param: str) -> str:
    """`exp_avg as torch.float32 (4, 2)`, or `prev_loss as a setting`: an entry's name and
    what its key says of it."""
    kind = entry.key.split("|", 2)[2]
    what = "a setting" if kind == "setting" else kind.replace("|", " ")
    return f"{_short(entry.name, param)} as {what}"


def _short(entry_name: str, param: str) -> str:
    """`momentum_buffer` for `h.0.c_q.weight momentum_buffer`."""
    return entry_name[len(param) + 1 :] if entry_name.startswith(param + " ") else entry_name
