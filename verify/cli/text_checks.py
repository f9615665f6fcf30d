"""The reports of `consistency`, `equivalence` and `hang`, as text (formatting only: every
verdict is decided by the checks)."""

from __future__ import annotations

import math

from tabulate import tabulate

from verify.checks.consistency import ConsistencyResult
from verify.checks.equivalence import EquivalenceResult
from verify.checks.failures import trace_findings
from verify.checks.hang import HangResult, ScenariosResult, as_expected
from verify.checks.reference import TensorError
from verify.checks.verdict import Finding
from verify.hints.table import first_hint, situation_of, with_hints
from verify.watching.diagnose import ONLY_UNTRACED


def header(o) -> str:
    """A check's first line, from its options alone (`consistency` and `equivalence`; `hang`
    adds its time after it): what ran, as the docs' examples show it."""
    if hasattr(o, "stall_timeout_s"):  # HangOptions
        what = o.impl or " ".join(o.script)
        world = "ranks its launcher starts" if o.launcher else f"world size {o.ranks}"
        return f"hang check: {what}, {world}, stall timeout {o.stall_timeout_s:g}s"
    head = (
        f"{o.command}: {o.impl} on {o.workload}, world size {o.world_size}, "
        f"{_plural(o.steps, 'step')}{_bucket(o)}"
    )
    return head + (f", {o.optimizer} lr {o.lr:g}" if o.command == "equivalence" else "")


def consistency(result: ConsistencyResult) -> str:
    lines = [header(result.options), ""]
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
                m.at, m.name, ",".join(map(str, m.ranks)), m.reference_rank,
                "-" if m.max_abs_diff is None else f"{m.max_abs_diff:.3g}",
                "-" if m.differing is None else f"{m.differing}/{m.numel}",
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
    lines = [header(result.options), ""]
    report = result.report
    if report is not None and report.rows:
        # A run that stopped early compared only what it reached: "equal" means so far.
        rows = [_row(e, so_far=result.failure is not None) for e in report.rows]
        headers = ["", "tensor", "max |err|", "/ max |ref|", "tolerance", "err/tol", "worst at", ""]
        lines += [tabulate(rows, headers=headers, disable_numparse=True), ""]
    notes = tuple(report.notes) if report is not None else ()
    return "\n".join(lines + _tail(result, notes))


def _bucket(o) -> str:
    """ ", bucket 25 MB" for a wrapper given a bucket size; nothing for one that takes none."""
    from impls.registry import resolve

    return f", bucket {o.bucket_mb:g} MB" if resolve(o.impl).takes_buckets else ""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _tail(result, notes: tuple[str, ...] = ()) -> list[str]:
    """Findings, the launcher's diagnosis, notes, the machine's thread budget, the verdict."""
    lines = []
    findings: tuple[Finding, ...] = result.findings
    hints = [_line(f.hint) for f in findings]  # chosen by kind and numbers (hints/table.py)
    if len(findings) > 1 or (findings and not result.headline.endswith(findings[0].describe())):
        lines.append("findings (every distinct one, in the order they showed):")
        for i, (f, h) in enumerate(zip(findings, hints, strict=True), 1):
            again = h in hints[: i - 1]  # the same cause under several findings: said once
            lines += [f"  {i}. [{f.phase}] {f.describe()}"] + (
                [f"     {h}"] if h and not again else []
            )
        lines.append("")
    elif hints and hints[0]:
        lines += [hints[0], ""]
    if result.failure:
        lines += [result.failure]
        h = _line(first_hint(result.failure_findings))
        lines += [h, ""] if h and h not in hints else [""]
    lines += [f"note: {n}" for n in (*notes, *result.notes)]
    if result.threads:
        lines.append(f"note: ranks ran with {result.threads}")
    lines.append(f"{result.headline}  ({result.elapsed_s:.1f}s)")
    return lines


def _line(hint: str | None) -> str | None:
    """A finding's hint as its report line."""
    return f"hint: {hint}" if hint else None


def _row(e: TensorError, *, so_far: bool = False) -> list[str]:
    """A tensor's worst check (largest error/tolerance over steps and ranks) as a table row;
    `so_far`: the run stopped before its last step."""
    if e.ratio == 0:  # no element differed at any step, on any rank
        if e.detail:  # "None in both": no gradient in any step, here or in one process
            return [e.kind, e.tensor, "-", "-", "-", "-", "-", e.detail]
        equal = "bitwise equal until the run stopped" if so_far else "bitwise equal"
        return [e.kind, e.tensor, "0", "0", "-", "0", "-", equal]
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
    head = f"{header(o)} ({result.elapsed_s:.1f}s)"
    d = result.diagnosis
    lines = [head, d.text() if d.faulty or d.verdict != "ok" else _ok(d, o, result.notes)]
    lines += diagnosis_hint(d, o)
    return "\n".join(lines + watched_tail(result) + [f"report: {result.report_dir}"])


def diagnosis_hint(d, o) -> list[str]:
    """The hint line of a run's diagnosis (a script's crash or hang, as a check's): none
    where its findings point at no cause the table knows (`hints/table.py`)."""
    h = _line(first_hint(with_hints(trace_findings(d), situation_of(o))))
    return [h] if h else []


def watched_tail(run) -> list[str]:
    """The races `--sanitize` found, what `--on-cpu` mapped, the launcher's notes and the
    thread budget of a run under the watchdog (`hang`, `audit`)."""
    lines = []
    if run.races:
        lines.append(f"RACES: {len(run.races)} found by --sanitize:")
        lines += [f"  - {r['message']}" for r in run.races[:10]]
    if run.on_cpu is not None:  # --on-cpu: what the rehearsal mapped, by call site
        from verify.oncpu import report

        lines += report.lines(run.on_cpu)
    lines += [f"note: {n}" for n in run.notes]
    if run.threads:
        lines.append(f"note: ranks ran with {run.threads}")
    return lines


def _ok(d, o, notes=()) -> str:
    if d.headline.startswith("no collective"):
        return f"NO COLLECTIVES: {d.headline}"
    if d.headline == ONLY_UNTRACED:  # nothing was compared: say so, not "every one matched"
        return d.headline
    ok = "no hang: every rank finished and every collective matched on every rank"
    if (
        o.impl
    ):  # what it covered: each hang-prone workload it ran (a note says why not), a few steps
        from verify.checks.hang import HANG_WORKLOADS

        ran = [w for w, _ in HANG_WORKLOADS if not any(f"workload {w} not run" in n for n in notes)]
        names = ", ".join(ran)
        return f"{ok} ({o.steps} SGD steps on each of the workloads {names})"
    return ok


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
