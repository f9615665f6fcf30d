"""Who to blame when ranks disagree on a collective, and what the earlier steps predict.

Training repeats itself: step N issues the collectives step N-1 did, from the same lines. When
the ranks disagree at collective #k (a different op, size or call site), the culprit is found
by, in order (`Blame`):

- MAJORITY: the ranks in the smaller bloc (with three or more ranks there usually is one);
- HISTORY: with a tie (two ranks), the one that broke the pattern of the earlier steps: the
  (op, call site, count) that followed the longest matching run of earlier calls (`expected`);
- EXTRA: else the one whose later collectives line up with the others' from #k on (it issued
  extra ones first: `extra_ops`);
- REFERENCE: else the lowest rank is taken as the reference, and the report says so.

`pattern_break` applies the same history to one rank alone: what a survivor's trace says when
its peer's records are gone (a node that died).
"""

from __future__ import annotations

from enum import Enum

from verify.watching.findings import TraceFinding
from verify.watching.stacks import at
from verify.watching.trace_file import Record, Trace


class Blame(Enum):
    """Why the culprits of a disagreement are who they are (module docstring)."""

    MAJORITY = ""
    HISTORY = " (the others follow the earlier steps)"
    EXTRA = " (its later collectives match the others' from this one on)"
    REFERENCE = " (taking rank {reference} as the reference)"

    def note(self, reference: int) -> str:
        """What the report adds after the finding: empty for a majority."""
        return self.value.format(reference=reference)


def culprits(attr, k, present: dict[int, Record], colls) -> tuple[list[int], Blame]:
    """The ranks to blame for a disagreement at #k in `attr`, and why (`Blame`)."""
    by_value: dict[object, list[int]] = {}
    for r, rec in present.items():
        key = getattr(rec, attr) if attr != "site" else rec.site
        if attr in ("op", "numel", "dtype"):
            key = (rec.op, rec.numel, rec.dtype, rec.site)
        by_value.setdefault(key, []).append(r)
    blocs = sorted(by_value.values(), key=len, reverse=True)
    if len(blocs[0]) > len(blocs[1]):
        return [r for b in blocs[1:] for r in b], Blame.MAJORITY
    predicted = expected(k, colls)
    if predicted is not None:
        keep = [r for r, rec in present.items() if token(rec) == predicted]
        if keep and len(keep) < len(present):
            return [r for r in present if r not in keep], Blame.HISTORY
    extra = extra_ops(k, present, colls)
    if extra:
        return extra, Blame.EXTRA
    ref = by_value[next(key for key, rs in by_value.items() if min(present) in rs)]
    return [r for r in present if r not in ref], Blame.REFERENCE


def token(rec: Record) -> tuple:
    """What history compares: the op, its call site and its element count."""
    return (rec.op, rec.site, rec.numel)


def expected(k, colls, window: int = 2000, longest: int = 64, least: int = 3) -> tuple | None:
    """The (op, call site, count) history predicts for #k: find the earlier point whose
    preceding calls match the calls just before #k for longest (the ranks agree up to #k-1),
    and take what came next there. A loop of per-gradient all-reduces followed by one flag
    all-reduce predicts the flag, not another gradient, at the end of step 2; buckets
    launched from one line predict the next bucket's size. A match shorter than `least` calls
    is a coincidence (two biases of the same size), not a pattern: no prediction."""
    history = colls[next(iter(colls))]
    tokens = [token(history[s]) if s in history else None for s in range(k)]
    best, best_len = None, 0
    for j in range(k - 2, max(0, k - window), -1):
        n = 0
        while (
            n < longest
            and j - n > 0
            and tokens[j - n] is not None
            and (tokens[j - n] == tokens[k - 1 - n])
        ):
            n += 1
        if n > best_len and tokens[j + 1] is not None:
            best, best_len = tokens[j + 1], n
    return best if best_len >= least else None


def extra_ops(k, present, colls, most: int = 8) -> list[int]:
    """Ranks whose records from #k+j on repeat another rank's from #k on (j extra ops)."""

    def sigs(r, start):
        c = colls[r]
        return [(c[s].op, c[s].numel, c[s].site) for s in range(start, max(c) + 1) if s in c]

    found = []
    for r in present:
        for o in present:
            if o == r:
                continue
            theirs = sigs(o, k)
            for j in range(1, most + 1):
                mine = sigs(r, k + j)
                m = min(len(mine), len(theirs))
                if m >= 1 and mine[:m] == theirs[:m]:
                    found.append(r)
                    break
            if r in found:
                break
    return found if 0 < len(found) < len(present) else []


def pattern_break(trace: Trace, group: str = "world") -> TraceFinding | None:
    """A skip seen from one side: the rank's last collective on `group`, still pending or
    failed, is not the one its own earlier steps issued at that point. What a backend abort leaves when the peer that
    aborted took its records with it (its node is gone): the survivor's history still says
    which collective it skipped. None when the history predicts nothing or agrees."""
    colls = trace.collectives(group)
    if not colls:
        return None
    k = max(colls)
    predicted = expected(k, {trace.rank: colls})
    last = colls[k]
    if last.state == "completed" or predicted is None or predicted == token(last):
        return None  # (a completed one is not the collective the run broke in)
    ref = next(r for s, r in sorted(colls.items(), reverse=True) if token(r) == predicted)
    kind = " ".join(p for p in (ref.dtype, ref.shape, ref.reduce_op) if p)
    what = (
        f"rank {trace.rank} skipped {ref.op} on {ref.group} [{kind}] {at(ref.site)} (every earlier "
        f"step issued it there) and issued {last.describe()} {at(last.site)} in its place"
    )
    return TraceFinding(
        "skipped collective", trace.rank, what, last.describe(), ref.site, last.site
    )
