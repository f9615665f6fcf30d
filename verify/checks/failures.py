"""A run that did not end with every rank returning, as typed findings: what the collective
trace diagnosed (a mismatch, a hang) and what a rank raised, each with its kind and numbers
(`hints/kinds.py`), so a failure gets its hint the way a check's finding does (`hints/table.py`)."""

from __future__ import annotations

from verify.checks.verdict import Finding
from verify.hints import kinds
from verify.hints.table import Situation, with_hints


def trace_findings(diagnosis) -> tuple[Finding, ...]:
    """The collective trace's findings (`watching.findings.Diagnosis`), typed: a mismatch
    by its kind and op, a rank parked while the others wait as a hang."""
    if diagnosis is None or not diagnosis.faulty:
        return ()
    out = []
    for t in diagnosis.findings:
        numbers = {"trace_kind": t.kind, "op": t.op, "culprit": t.rank, "hangs": t.hangs}
        hang = ("stalled", "stuck outside collectives", "left early")
        kind = kinds.HANG if t.kind in hang else None
        out.append(
            Finding(
                "run",
                "run",
                0,
                t.message,
                ranks=(t.rank,),
                where=t.culprit_site,
                kind=kind or kinds.COLLECTIVE_MISMATCH,
                numbers=numbers,
            )  # fmt: skip
        )
    return tuple(out)


def failure_findings(run, situation: Situation | None = None) -> tuple[Finding, ...]:
    """A failed launch (`LaunchResult`) as typed findings, with their hints: the trace's
    diagnosis first (it names the mismatch a crash came from), then the first rank's raise.
    Nothing for a run that ended well or only ran out of time."""
    if run.ok or run.timed_out and run.diagnosis is None:
        return ()
    found = list(trace_findings(run.diagnosis))
    root = run.first_failure
    if root is not None and root.status == "error" and root.raised:
        first = (root.error or "").splitlines()[0] if root.error else ""
        numbers = {**root.raised, "rank": root.rank}
        found.append(
            Finding(
                "run",
                "run",
                0,
                f"rank {root.rank} raised {first}",
                ranks=(root.rank,),
                where=root.where() or None,
                kind=kinds.RAISED,
                numbers=numbers,
            )  # fmt: skip
        )
    return with_hints(found, situation or Situation(run.world_size))


def hinted_diagnosis(diagnosis) -> dict:
    """A diagnosis as JSON (`Diagnosis.to_dict`), each of its findings with its kind,
    numbers and hint, as a check's findings carry them."""
    doc = diagnosis.to_dict()
    typed = with_hints(trace_findings(diagnosis), Situation(max(2, len(diagnosis.ranks))))
    if len(typed) == len(doc.get("findings", ())):
        for fd, f in zip(doc["findings"], typed, strict=True):
            fd.update(finding_kind=f.kind, numbers=f.numbers, hint=f.hint)
    return doc
