"""The reports of `consistency`, `equivalence` and `hang`, as text (formatting only: every
verdict is decided by the checks)."""

from __future__ import annotations

import math

from tabulate import tabulate

from verify.checks.consistency import ConsistencyResult
from verify.checks.equivalence import EquivalenceResult
from verify.checks.hang import HangResult, ScenariosResult, as_expected
from verify.checks.reference import TensorError
from verify.checks.verdict import Finding


def consistency(result: ConsistencyResult) -> str:
    o = result.options
    lines = [
        f"consistency: {o.impl} on {o.workload}, world size {o.world_size}, {o.steps} steps, "
        f"bucket {o.bucket_mb:g} MB",
        "",
    ]
    if result.checkpoints:
        rows = [
            [c.label, c.tensors, c.mismatched, f"{c.seconds * 1e3:.1f}"] for c in result.checkpoints
        ]
        lines += [tabulate(rows, headers=["checkpoint", "tensors", "mismatched", "audit ms"]), ""]
    if result.mismatches:
        shown = result.mismatches[:20]
        detail = any(m.detail for m in shown)
        rows = [
            [
                m.checkpoint, m.tensor, ",".join(map(str, m.ranks)), m.reference_rank,
                "-" if m.max_abs_diff is None else f"{m.max_abs_diff:.3g}",
                "-" if m.num_different is None else f"{m.num_different}/{m.numel}",
                "-" if m.first_index is None else str(list(m.first_index)),
            ] + ([m.detail] if detail else [])
            for m in shown
        ]  # fmt: skip
        headers = ["checkpoint", "tensor", "ranks", "vs rank", "max |diff|", "differ", "first"]
        lines += [tabulate(rows, headers=headers + ([""] if detail else [])), ""]
        if len(result.mismatches) > len(shown):
            lines += [f"(and {len(result.mismatches) - len(shown)} more mismatches)", ""]
    return "\n".join(lines + _tail(result))


def equivalence(result: EquivalenceResult) -> str:
    o = result.options
    lines = [
        f"equivalence: {o.impl} on {o.workload}, world size {o.world_size}, {o.steps} steps, "
        f"bucket {o.bucket_mb:g} MB, {o.optimizer} lr {o.lr:g}",
        "",
    ]
    report = result.report
    if report is not None and report.rows:
        rows = [_row(e) for e in report.rows]
        headers = ["", "tensor", "max |err|", "/ max |ref|", "tolerance", "err/tol", "worst at", ""]
        lines += [tabulate(rows, headers=headers, disable_numparse=True), ""]
    notes = tuple(report.notes) if report is not None else ()
    return "\n".join(lines + _tail(result, notes))


def _tail(result, notes: tuple[str, ...] = ()) -> list[str]:
    """Findings, the launcher's diagnosis, notes, the machine's thread budget, the verdict."""
    lines = []
    findings: tuple[Finding, ...] = result.findings
    if len(findings) > 1 or (findings and not result.headline.endswith(findings[0].describe())):
        lines.append("findings (every distinct one, in the order they showed):")
        lines += [f"  {i}. [{f.phase}] {f.describe()}" for i, f in enumerate(findings, 1)]
        lines.append("")
    if result.failure:
        lines += [result.failure, ""]
    lines += [f"note: {n}" for n in (*notes, *result.notes)]
    if result.threads:
        lines.append(f"note: ranks ran with {result.threads}")
    lines.append(f"{result.headline}  ({result.elapsed_s:.1f}s)")
    return lines


def _row(e: TensorError) -> list[str]:
    """A tensor's worst check (largest error/tolerance over steps and ranks) as a table row."""
    if e.ratio == 0:  # no element differed at any step, on any rank
        if e.detail:  # "None in both": no gradient in any step, here or in one process
            return [e.kind, e.tensor, "-", "-", "-", "-", "-", e.detail]
        return [e.kind, e.tensor, "0", "0", "-", "0", "-", "bitwise equal"]
    where = "construction" if e.step == 0 else f"step {e.step}"
    return [
        e.kind, e.tensor, _num(e.max_abs), _num(e.max_rel), _num(e.tolerance),
        _num(e.ratio, ".2f"), f"{where}, rank {e.rank}", e.detail or ("ok" if e.passed else "OVER"),
    ]  # fmt: skip


def _num(value: float, spec: str = ".3g") -> str:
    return f"{value:{spec}}" if math.isfinite(value) else "-"


# --- hang --------------------------------------------------------------------------------


def hang(result: HangResult | ScenariosResult) -> str:
    if isinstance(result, ScenariosResult):
        return scenarios(result)
    o = result.options
    what = o.impl or " ".join(o.script)
    head = (
        f"hang check: {what}, world size {o.ranks}, stall timeout {o.stall_timeout_s:g}s "
        f"({result.elapsed_s:.1f}s)"
    )
    d = result.diagnosis
    lines = [head, d.text() if d.faulty or d.verdict != "ok" else _ok(d)]
    return "\n".join(lines + watched_tail(result) + [f"report: {result.report_dir}"])


def watched_tail(run) -> list[str]:
    """The races `--sanitize` found, the launcher's notes and the thread budget of a run
    under the watchdog (`hang`, `audit`)."""
    lines = []
    if run.races:
        lines.append(f"RACES: {len(run.races)} found by --sanitize:")
        lines += [f"  - {r['message']}" for r in run.races[:10]]
    lines += [f"note: {n}" for n in run.notes]
    if run.threads:
        lines.append(f"note: ranks ran with {run.threads}")
    return lines


def _ok(d) -> str:
    if d.headline.startswith("no collective"):
        return f"NO COLLECTIVES: {d.headline}"
    return "no hang: every rank finished and every collective matched on every rank"


def scenarios(result: ScenariosResult) -> str:
    from impls.faulty import hang_scenarios

    rows = []
    for r in result.results:
        d = r.diagnosis
        kind = next((f.kind for f in d.findings if f.message == d.headline), "")
        detect = "-" if d.detection_s is None or d.verdict == "desync" else f"{d.detection_s:.1f}"
        rows.append([
            r.options.impl, hang_scenarios.SCENARIOS[r.options.impl][2], d.verdict,
            "-" if d.culprit is None else d.culprit, kind, (d.collective or "-")[:60], detect,
            f"{r.elapsed_s:.1f}", "yes" if as_expected(r) else "NO",
        ])  # fmt: skip
    headers = ["scenario", "built to", "verdict", "culprit", "finding", "collective",
               "detected s", "run s", "as expected"]  # fmt: skip
    hangs = [r.diagnosis.detection_s for r in result.results if r.diagnosis.verdict == "hang"]
    worst = max((h for h in hangs if h is not None), default=None)
    bar = result.options.stall_timeout_s + 2
    tail = (
        f"slowest hang detection {worst:.1f}s after the last progress (bar: stall timeout + 2 = "
        f"{bar:g}s: {'met' if worst <= bar else 'MISSED'})"
        if worst is not None
        else "no hang verdicts"
    )
    return f"{tabulate(rows, headers=headers)}\n\n{tail}"
