"""The reports of `matrix`, `faults` and `clean`, as text (formatting only; `list` is
`text_list.py`, kept apart so that printing it imports no checker)."""

from __future__ import annotations

from tabulate import tabulate

from verify.checks.behaviours import BEHAVIOUR
from verify.checks.cells import CHECKS
from verify.checks.detection import DetectionResult
from verify.checks.matrix import MatrixResult
from verify.checks.verdict import NOTHING
from verify.hints.table import first_hint

SYMBOL = {"pass": "ok", "fail": "FAIL", "not claimed": "not claimed", "n/a": "n/a",
          "timeout": "TIMEOUT"}  # fmt: skip
COMPACT = {"pass": "✓", "fail": "✗", "not claimed": "–", "n/a": "·", "timeout": "?"}


def matrix(result: MatrixResult) -> str:
    """The matrix's report: the table, the failures with their hints, why cells were not
    claimed (and, when nothing could be judged, why each was n/a), and the verdict line."""
    o = result.options
    single = len(o.impl_names) == 1
    lines = _single_table(result) if single else _compact_table(result)
    failures = [(k, r) for k, r in result.results.items() if r.failed]
    if failures:
        lines += ["", "failures:"]
        said: set[tuple[str, str]] = set()  # a cause is said once per implementation
        for (impl, key, check), r in failures:
            where = f"{BEHAVIOUR[key].title} / {check}"
            where = where if single else f"{impl} / {where}"
            lines.append(f"  {where}: {r.headline}")
            hint_lines = _hint_lines(r)
            lines += [h for h in hint_lines if (impl, h) not in said]
            said.update((impl, h) for h in hint_lines)
    claims = {(i, r.detail) for (i, _, _), r in result.results.items() if r.status == "not claimed"}
    lines += _reasons("not claimed:", claims, single)
    if result.verdict == NOTHING:  # every cell says why it could not be judged
        skipped = {(i, r.detail) for (i, _, c), r in result.results.items()
                   if r.status == "n/a" and c in result.checks_for(i)}  # fmt: skip
        lines += _reasons("n/a:", skipped, single)
    counts = _counts(result)
    lines += ["", _SANITIZED if o.sanitize else _UNSANITIZED]
    verdict = result.verdict.upper()
    lines += ["", f"{verdict}: {counts}  ({result.elapsed_s:.0f}s, {_launches(result.launches)})"]
    return "\n".join(lines)


def _single_table(result: MatrixResult) -> list[str]:
    """One implementation: a column per check, a word per cell."""
    (impl,) = result.options.impl_names
    checks = result.checks_for(impl)
    rows = [
        [b.title, *(SYMBOL[result.result(impl, b.key, c).status] for c in checks)]
        for b in result.options.behaviours
    ]
    return [f"certification matrix: {impl}", "", tabulate(rows, headers=["behaviour", *checks])]


def _compact_table(result: MatrixResult) -> list[str]:
    """Several implementations: a column each, a symbol per check in its cell, and the legend."""
    o = result.options
    rows = [
        [b.title, *("".join(COMPACT[result.result(i, b.key, c).status]
                            for c in result.checks_for(i)) for i in o.impl_names)]
        for b in o.behaviours
    ]  # fmt: skip
    legend = (
        "✓ pass  ✗ fail  – not claimed  · n/a  ? timed out   (the shard check for sharded "
        "optimizers only)"
    )
    table = tabulate(rows, headers=["behaviour", *o.impl_names])
    return [f"certification matrix (cell: {', '.join(o.checks)})", "", table, "", legend]


def _reasons(title: str, reasons: set[tuple[str, str]], single: bool) -> list[str]:
    """A section of (implementation, why) pairs, sorted, each said once; the implementation
    named only when the matrix has several; nothing when there are none."""
    if not reasons:
        return []
    return ["", title, *(f"  {why}" if single else f"  {i}: {why}" for i, why in sorted(reasons))]


_SANITIZED = (
    "note: every cell ran under the race sanitizer (--no-sanitize to skip it); it cannot see the "
    "collectives PyTorch DDP's C++ reducer issues (torch-ddp, torch-zero and the sharded "
    "optimizers that run over them)"
)
_UNSANITIZED = (
    "note: --no-sanitize: races on async collectives were not checked; a racy class's cells pass "
    "or fail by timing, so its verdicts may differ from run to run"
)


def _launches(n: int) -> str:
    return f"{n} launch{'es' if n != 1 else ''}"


def _counts(result: MatrixResult) -> str:
    """Cells by status, over the columns shown (no shard column for DDP wrappers)."""
    statuses = [r.status for (i, _, c), r in result.results.items() if c in result.checks_for(i)]
    parts = [f"{statuses.count(s)} {s}" for s in ("pass", "fail", "not claimed", "n/a", "timeout")]
    return ", ".join(p for p in parts if not p.startswith("0 "))


def detection(result: DetectionResult) -> str:
    rows = []
    for d in result.detections:
        cells = [_detected(d.checks[c]) if c in d.checks else "-" for c in CHECKS]
        rows.append(
            [d.name, ", ".join(d.shows_on), *cells, d.caught_by, "yes" if d.caught else "NO"]
        )
    headers = ["faulty implementation", "behaviour", *CHECKS, "must be caught by", "caught"]
    lines = ["detection matrix", "", tabulate(rows, headers=headers), "", "how each was caught:"]
    for d in result.detections:
        check = d.caught_by
        lines.append(f"  {d.name} ({check}, {d.where[check]}): {d.checks[check].headline}")
        lines += _hint_lines(d.checks[check])
    lines.append("")
    missed = [d.name for d in result.detections if not d.caught]
    if missed:
        lines.append(f"NOT CAUGHT by their check: {', '.join(missed)}")
    if result.controls:
        flagged = result.false_alarms
        n = len(result.controls)
        if flagged:
            lines.append(f"correct implementations FLAGGED ({len(flagged)} cells):")
            for (impl, key, check), r in flagged:
                lines.append(f"  {impl} / {key} / {check}: {r.headline}")
        else:
            lines.append(
                f"controls: {', '.join(result.controls)} pass every check on the same "
                f"behaviours ({n} implementations, none flagged)"
            )
    verdict = "PASS" if result.passed else "FAULT"
    caught = sum(d.caught for d in result.detections)
    lines.append(
        f"{verdict}: {caught}/{len(result.detections)} faulty implementations caught by their "
        f"check  ({result.matrix.elapsed_s:.0f}s, {_launches(result.matrix.launches)})"
    )
    return "\n".join(lines)


def cell_hint(cell) -> str | None:
    """The hint line of a failed cell: its first finding's that has one (chosen by kind and
    numbers in the situation its behaviour sets, when the cell ran: hints/table.py)."""
    h = first_hint(cell.findings)
    return f"hint: {h}" if h else None


def _hint_lines(cell) -> list[str]:
    h = cell_hint(cell)
    return [f"    {h}"] if h else []


def _detected(r) -> str:
    return {"fail": "FAULT", "pass": "pass"}.get(r.status, r.status)


def cleaned(result) -> str:
    """What `clean` removed (or would remove, with --dry-run) and what it kept."""
    from verify.runs import human_bytes

    o = result.options
    verb = "would remove" if o.dry_run else "removed"
    lines = [f"  {path}" for path in result.removed]
    head = (
        f"{verb} {len(result.removed)} run folder{'s' * (len(result.removed) != 1)} under "
        f"{o.out}/ ({human_bytes(result.freed_bytes)}), kept the newest {len(result.kept)}"
    )
    return "\n".join([head, *lines])
