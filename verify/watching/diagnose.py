"""Diagnose a hang, a crash or a desync from every rank's collective trace.

`diagnose(traces, ranks, stalled=...)` lines the ranks' records up by (process group, sequence
number) and walks them in order. The first collective where the ranks disagree explains a hang
or a backend abort:

- *missing*: some ranks issued collective #k, others never did; what those others are doing
  instead comes from their state: dead (exit code or signal), finished, waiting in another
  collective or a send/recv, or outside any collective (their stack says where). Where those
  others finished (or failed only as a peer left) and never issued any collective at #k's
  line, while they are no fewer than the ranks that did, #k is a collective *issued on some
  ranks only* (an all-reduce in an evaluate() run by rank 0): those that issued it are the
  culprits;
- *op*, *count* and *dtype mismatches*: the ranks are in different collectives, or the same
  one with different sizes (gloo aborts with "Received data size doesn't match", or hangs).

Disagreements that do not hang are reported as *desyncs* and the walk goes on: a reduce-op
mismatch (SUM on one rank, MAX on another), a shape mismatch with the same element count, a
broadcast (or reduce, gather, scatter) root mismatch, and, in a run that hung, different call
sites of the collective the ranks are stuck in.

Who is the culprit when two ranks disagree? In order: the ranks that never issued the
collective; the minority when there is a strict majority; the rank that broke the pattern of
the earlier steps (after the call site that precedes #k, the history says which site came next
last time); the rank that issued extra collectives (its later records match the other's from
#k on); and otherwise the ranks that differ from the lowest rank, said so in the finding.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verify.launching.outcome import RankOutcome
    from verify.watching.spawned import OwnRanks

from verify.watching import history, spawned
from verify.watching.findings import Diagnosis, TraceFinding
from verify.watching.history import Blame, token
from verify.watching.ops import ROOTED_OPS, UNEVEN_OPS
from verify.watching.ranks import (
    failure_finding,
    instead,
    is_echo,
    left_early,
    stall_finding,
    where,
)
from verify.watching.stacks import at, dump_in_torch
from verify.watching.trace_file import Record, Trace

STRUCTURAL = ("missing", "op mismatch", "size mismatch", "dtype mismatch")
_TIMED_OUT = (
    "the run did not finish within its timeout, and no rank was hung (every rank that was not "
    "waiting in a collective was working): no verdict"
)
_NONE_SEEN = (
    "no collective was observed on any rank: nothing to check (does the script call "
    "init_process_group and issue collectives?)"
)
ONLY_UNTRACED = (
    "no hang: every collective was issued by torch from C++ (PyTorch DDP's), which the trace "
    "does not record: the ranks' progress was watched, no collective was compared"
)


def diagnose(
    traces: list[Trace | None],
    ranks: list[RankOutcome],
    *,
    stalled: bool = False,
    stall_timeout_s: float | None = None,
    detection_s: float | None = None,
    now: float | None = None,
    failure_order: tuple[int, ...] = (),
    timed_out: bool = False,
    own_ranks: tuple[OwnRanks, ...] = (),
) -> Diagnosis:
    """Compare the ranks' records; see the module docstring for the rules.

    `stalled`: the watchdog called a hang; `timed_out`: the deadline passed with no hang and
    no failure (the verdict is then "timeout": the run could not be judged, not a fault);
    `own_ranks`: ranks that started ranks of their own (`spawned.py`), whose processes no
    one watched: short of a fault among the ranks that were, the verdict is "unwatched" (no
    verdict, exit 2)."""
    now = time.time() if now is None else now
    findings: list[TraceFinding] = []
    for group in _groups(traces):
        findings += _walk_group(group, _members(group, len(ranks)), traces, ranks, stalled)
    failed = [r for r in ranks if r.status in ("crashed", "error")]
    failed.sort(
        key=lambda r: (r.rank not in failure_order, list(failure_order + (r.rank,)).index(r.rank))
    )
    lines = tuple(where(r, traces[r.rank] if r.rank < len(traces) else None, now) for r in ranks)
    if own_ranks and not any(f.hangs for f in findings) and not failed:
        return Diagnosis("unwatched", spawned.headline(own_ranks[0], stalled=stalled),
                         culprit=own_ranks[0].rank, site=own_ranks[0].site, ranks=lines,
                         stall_timeout_s=stall_timeout_s, detection_s=detection_s)  # fmt: skip
    if not (stalled or failed or findings):
        return _no_fault(traces, lines, timed_out, stall_timeout_s)
    head, findings = _lead(findings, failed, stalled, ranks, traces, now)
    return Diagnosis(
        "hang" if stalled else "crash" if failed else "desync",
        head.message,
        culprit=head.rank,
        collective=head.collective,
        site=head.site,
        findings=tuple(findings),
        ranks=lines,
        stall_timeout_s=stall_timeout_s,
        detection_s=detection_s,
    )


def _lead(findings, failed, stalled, ranks, traces, now) -> tuple[TraceFinding, list]:
    """The finding a diagnosis leads with, and all its findings: the first structural one
    (what hangs); else the root failure's (`failed[0]`) or the stall's, put first; else
    the first desync. `findings` is not empty, or a rank failed, or the run stalled."""
    structural = [f for f in findings if f.hangs]
    if structural:
        return structural[0], findings
    if failed:
        # A failure that echoes a peer leaving, with no rank crashed: the peers that finished
        # left while it still needed them.
        crashed = any(not is_echo(r.error) for r in failed)
        finished = [r for r in ranks if r.status == "ok"]
        head = None if crashed else left_early(failed[0], finished)
        head = head or failure_finding(failed[0], traces, now)
    elif stalled:
        head = stall_finding(ranks, traces)
    else:
        return findings[0], findings
    return head, [head, *findings]


def _no_fault(traces, lines: tuple[str, ...], timed_out: bool, stall_timeout_s) -> Diagnosis:
    """The diagnosis of a run with no hang, no failure and no finding: "timeout" when it ran
    out of time (no verdict), else "ok", saying what was compared."""
    if timed_out:
        return Diagnosis("timeout", _TIMED_OUT, ranks=lines, stall_timeout_s=stall_timeout_s)
    if any(t is not None and t.records for t in traces):
        summary = "no hang, no desync: every collective matched on every rank"
    elif any(t is not None and t.events for t in traces):
        # Events with no record: returns of calls into torch that issue collectives from C++
        # (watching/untraced.py), such as a DDP backward.
        summary = ONLY_UNTRACED
    else:
        summary = _NONE_SEEN
    return Diagnosis("ok", summary, ranks=lines, stall_timeout_s=stall_timeout_s)


# ------------------------------------------------------------ the walk


def _groups(traces) -> list[str]:
    seen: dict[str, None] = {}
    for t in traces:
        for r in t.records if t else ():
            if not r.p2p:
                seen.setdefault(r.group)
    return sorted(seen, key=lambda g: (g != "world", g))


def _members(group: str, world: int) -> list[int]:
    if group == "world":
        return list(range(world))
    return [int(x) for x in re.findall(r"\d+", group)]


_CUT_SHORT = ("timeout", "killed")  # outcome statuses of ranks ended while still running


def _walk_group(group, members, traces, ranks, stalled) -> list[TraceFinding]:
    """The findings of one process group, collective by collective in issue order, up to the
    first that hangs: a rank that never issued #k (`_missing`), or ranks that disagree on it
    (`_compare`)."""
    colls = {r: traces[r].collectives(group) for r in members if r < len(traces) and traces[r]}
    if len(colls) < 2:
        return []
    first = {r: min(c) if c else 1 for r, c in colls.items()}  # older ones fell off the ring
    last = {r: max(c) if c else 0 for r, c in colls.items()}
    # A rank still running when the run was cut short may only be behind, still computing
    # towards collective k: at the deadline (no failure, no hang called) it never "missed" k.
    # Killed after a peer failed, it is behind unless that peer was waiting in k for it
    # (k issued and never completed there: then it is the one that never came).
    failed = [q for q in colls if q < len(ranks) and ranks[q].status in ("error", "crashed")]

    def behind(r: int, k: int) -> bool:
        status = ranks[r].status if r < len(ranks) else None
        if stalled or status not in _CUT_SHORT:
            return False
        waited = any(k in colls[q] and colls[q][k].state != "completed" for q in failed)
        return status == "timeout" or not waited

    findings = []
    for k in sorted(set().union(*colls.values())):
        present = {r: c[k] for r, c in colls.items() if k in c}
        known = [r for r in colls if first[r] <= k]
        absent = [r for r in known if r not in present and k > last[r] and not behind(r, k)]
        if absent:
            findings.append(_missing(k, present, absent, traces, ranks, colls, stalled))
            break
        findings += _compare(k, present, colls, stalled, last_common=min(last.values()))
        if findings and findings[-1].hangs:
            break
    return _collapse(findings)


def _compare(k, present: dict[int, Record], colls, stalled, last_common) -> list[TraceFinding]:
    """What the ranks that issued collective #k disagree on: the op or dtype (structural), else
    the size, else the shape, reduce op or root; and, where every rank is stuck in it at the
    last collective they share, the call site."""
    values = list(present.values())
    ref = values[0]
    for attr, kind in (("op", "op mismatch"), ("dtype", "dtype mismatch")):
        if any(getattr(v, attr) != getattr(ref, attr) for v in values):
            return [_mismatch(kind, attr, k, present, colls)]
    if ref.op not in UNEVEN_OPS and any(v.numel != ref.numel for v in values):
        return [_mismatch("size mismatch", "numel", k, present, colls)]
    found = []
    stuck = stalled and all(v.pending for v in values)  # in it on every rank: what hangs
    for attr, kind, applies in (
        ("shape", "shape mismatch", ref.op not in UNEVEN_OPS),
        ("reduce_op", "reduce-op mismatch", True),
        ("peer", _root_kind(ref.op), ref.op in ROOTED_OPS),
    ):
        if applies and any(getattr(v, attr) != getattr(ref, attr) for v in values):
            found.append(_mismatch(kind, attr, k, present, colls, hangs=stuck))
    if stuck and k == last_common and len({v.site for v in values}) > 1:
        found.append(_mismatch("call-site mismatch", "site", k, present, colls))
    return found


def _collapse(findings: list[TraceFinding], most: int = 10) -> list[TraceFinding]:
    """One finding per (kind, culprit, call site), saying how often it recurred."""
    seen: dict[tuple, list] = {}
    for f in findings:
        seen.setdefault((f.kind, f.rank, f.culprit_site), []).append(f)
    out = []
    for group in list(seen.values())[:most]:
        f = group[0]
        if len(group) > 1:
            f = replace(f, message=f"{f.message} [and {len(group) - 1} more time(s)]")
        out.append(f)
    return out


def _root_kind(op: str) -> str:
    return {"broadcast": "broadcast source mismatch", "scatter": "scatter source mismatch"}.get(
        op, f"{op} root mismatch"
    )


def _mismatch(kind, attr, k, present: dict[int, Record], colls, *, hangs=None) -> TraceFinding:
    if hangs is None:
        hangs = kind in STRUCTURAL or kind == "call-site mismatch"
    culprits, blame = history.culprits(attr, k, present, colls)
    culprit = culprits[0]
    others = [r for r in present if r not in culprits]
    ref = present[others[0]] if others else present[min(present)]
    bad = present[culprit]
    # A different call site where history expected the others' collective: a skip. The same
    # site with a different size is a reordering, reported as the mismatch it is, unless the
    # culprit broke the pattern and its records from #k on are the others' from a later one
    # (units reduce-scattered from one line, one of them left out on the culprit).
    skipped = (
        bad.site != ref.site
        and (
            blame is Blame.HISTORY
            or (
                attr in ("op", "numel", "dtype", "site")
                and history.expected(k, colls) == token(ref)
            )
        )
    ) or (blame is Blame.HISTORY and set(others) <= set(history.extra_ops(k, present, colls)))
    if skipped and hangs:
        what = (
            f"rank {culprit} skipped {ref.describe()} {at(ref.site)}, which rank(s) "
            f"{_ranks(others)} issued{' and wait in' if ref.pending else ''} (every earlier "
            f"step issued it there); rank {culprit} issued {bad.describe()} {at(bad.site)} instead"
        )
        return TraceFinding(
            "skipped collective", culprit, what, ref.describe(), ref.site, bad.site, op=ref.op
        )
    if blame is Blame.EXTRA and hangs:
        what = (
            f"rank {culprit} issued an extra {bad.describe()} {at(bad.site)} that rank(s) "
            f"{_ranks(others)} never issued (they issued {ref.describe()} {at(ref.site)}; rank "
            f"{culprit}'s later collectives line up with theirs from #{k} on)"
        )
        return TraceFinding(
            "extra collective", culprit, what, ref.describe(), bad.site, bad.site, op=bad.op
        )
    what = (
        f"{kind} at collective #{k} on {bad.group}: rank {culprit} issued {bad.describe()} "
        f"{at(bad.site)}; rank(s) {_ranks(others)} issued {ref.describe()} {at(ref.site)}"
    )
    tail = "" if hangs else " (completes, with wrong results: a desync)"
    note = blame.note(min(present))
    return TraceFinding(
        kind, culprit, what + tail + note, ref.describe(), ref.site, bad.site, hangs, ref.op
    )


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks)


def _missing(k, present, absent, traces, ranks, colls, stalled=False) -> TraceFinding:
    moved_on = _moved_on(k, present, absent, ranks, colls)
    if moved_on is not None:
        return moved_on
    only = _issued_by_some(k, present, absent, ranks, colls, stalled)
    if only is not None:
        return only
    culprit = absent[0]
    ref = present[min(present)]
    doing = instead(ranks[culprit], traces[culprit], colls[culprit])
    waiting = [r for r, rec in present.items() if rec.pending]
    who = f"rank(s) {_ranks(waiting or present)} " + ("wait in it" if waiting else "issued it")
    message = (
        f"rank {_ranks(absent)} never issued {ref.describe()}; {who} {at(ref.site)}; "
        f"rank {culprit} {doing[0]}"
    )
    return TraceFinding("missing", culprit, message, ref.describe(), ref.site, doing[1], op=ref.op)


ISSUED_BY_SOME = "issued on some ranks only"


def _issued_by_some(k, present, absent, ranks, colls, stalled) -> TraceFinding | None:
    """Collective #k issued at a line where the ranks that never issued it never issued any
    collective, while they went on to finish (or failed only as their peer left: an echo),
    and they are no fewer than those that issued it: a collective on some ranks only (an
    all-reduce in an evaluate() under `if rank == 0:`). The ranks that issued it are the
    culprits, not the ones that "never issued" it; None when that is not the shape of it,
    or when the run was only cut short at its deadline (no hang called, no failure: the
    ranks still waiting are not known to wait in vain)."""
    judged = stalled or any(ranks[r].status in ("error", "crashed") for r in present)
    if not judged or len(present) > len(absent):
        return None  # the minority skipped it: a skip (`_missing`'s own words)
    if not all(ranks[r].status == "ok" or is_echo(ranks[r].error) for r in absent):
        return None
    ref = present[min(present)]
    if any(c.site == ref.site for r in absent for c in colls[r].values()):
        return None  # the others issued collectives there before: they skipped this one
    them = f"rank{'s' if len(absent) > 1 else ''} {_ranks(absent)}"
    went = "finished" if all(ranks[r].status == "ok" for r in absent) else "lost its peers"
    message = (
        f"only rank{'s' if len(present) > 1 else ''} {_ranks(present)} issued {ref.describe()} "
        f"{at(ref.site)}: {them} never issued a collective at that line, and {went} (a "
        "collective on some ranks only)"
    )
    culprit = min(present)
    return TraceFinding(ISSUED_BY_SOME, culprit, message, ref.describe(), ref.site, ref.site,
                        op=ref.op)  # fmt: skip


def _moved_on(k, present, absent, ranks, colls) -> TraceFinding | None:
    """Collective #k is the first its ranks ever issued at its call site (a barrier after the
    training loop, say) and they wait in it, while every rank that never issued it is blocked
    inside torch's C++, in a collective the trace cannot see (PyTorch DDP's reducer, still
    in the loop): those ranks are not missing #k, the others moved on to it early, leaving a
    pattern the trace cannot show (uneven data: one rank out of batches first). The ranks
    waiting in #k are the culprits; None when that is not the shape of it."""
    if not all(ranks[r].status in _CUT_SHORT and dump_in_torch(ranks[r].stack) for r in absent):
        return None
    waiting = {r: rec for r, rec in present.items() if rec.pending}
    if not waiting or len(waiting) != len(present):
        return None
    if any(
        c.site == rec.site for r, rec in waiting.items() for c in colls[r].values() if c.seq < k
    ):
        return None  # issued there before: a pattern the trace does show (the rules above)
    culprit = min(waiting)
    ref = waiting[culprit]
    stuck = "; ".join(f"rank {r} {instead(ranks[r], None, {})[0]}" for r in absent)
    message = (
        f"rank {_ranks(waiting)} left the loop early: it waits in {ref.describe()} "
        f"{at(ref.site)} (its first collective there), while {stuck} (the ranks ran different "
        f"numbers of steps: uneven data, one rank running out of batches first?)"
    )
    doing = instead(ranks[absent[0]], None, {})[1]
    return TraceFinding("left early", culprit, message, ref.describe(), ref.site, doing, op=ref.op)
