"""The report of `audit` (and of `verify.audit_run` under torchrun), as text: formatting
only, every verdict is decided by the check (`checks/script_audit.py`)."""

from __future__ import annotations

from verify.checks.script_audit import AuditResult
from verify.checks.verdict import AUDIT_STOPPED, NOTHING_AUDITED
from verify.cli.text_checks import diagnosis_hint, watched_tail
from verify.launching.launcher import is_command
from verify.replica_audit.stillness import nothing_trained
from verify.script_audit import AuditReport, Finding
from verify.script_audit.report import SETTINGS, STATE_EVERY


def audit(result: AuditResult, recorded_alone: bool = False) -> str:
    """The report; `recorded_alone`: the run's one rank had no replicas to compare and
    recorded its steps (`--record/--against` at one rank), which is said instead of
    "audited: 0 steps" and the nothing-audited verdict (the recording's report follows)."""
    o, run = result.options, result.run
    every = "every optimizer step" if o.audit_every == 1 else f"every {o.audit_every}th step"
    n = ranks_of(result)
    ranks = f"{n} rank{'s' if n != 1 else ''}"
    lines = [f"audit: {' '.join(o.script)}, {ranks}, {every} ({run.elapsed_s:.1f}s)"]
    lines += findings(result.audit, recorded_alone)
    d = run.diagnosis
    if d.faulty or d.verdict != "ok":
        lines.append(d.text())
        lines += diagnosis_hint(d, o)
    lines += watched_tail(run)
    if recorded_alone and result.verdict == NOTHING_AUDITED:
        pass  # nothing to compare across ranks is no fault here: the recording's verdict follows
    elif not (d.faulty and not result.faults):  # the HANG or CRASH above is the verdict's line
        line = verdict_line(result.audit, result.verdict)
        if result.verdict == NOTHING_AUDITED and run.on_cpu is not None:  # left under --on-cpu
            from verify.oncpu import report

            line += f"; {report.left_early(run.on_cpu['mapped'], run.on_cpu['unmapped'])}"
        lines.append(line)
    return "\n".join(lines + [f"report: {result.report_dir}"])


def ranks_of(result: AuditResult) -> int:
    """The run's ranks: `--nproc`, or a launcher's, those that joined."""
    return len(result.run.pids) if is_command(result.options.script) else result.options.nproc


def findings(audited: AuditReport | None, recorded_alone: bool = False) -> list[str]:
    """The findings (first divergence, every distinct later one, what follows from them, the
    notes) and what was audited (`recorded_alone`: what one rank recorded, `audit`)."""
    if audited is None:
        return ["no audit report: the script never got to audit (see its output)"]
    lines: list[str] = []
    faults = [f for f in audited.findings if f.fault]
    causes = [f for f in faults if f.echo_of is None]
    for n, f in enumerate(causes):
        title = "FIRST DIVERGENCE" if n == 0 else "ANOTHER DIVERGENCE"
        lines += _block(f, title)
        echoes = [e for e in faults if e.echo_of == audited.findings.index(f)]
        if echoes:
            lines.append("  then, following from it:")
            lines += [f"    {e.where}: {_count(e)}{_again(e)}" for e in echoes]
    for f in audited.findings:
        if not f.fault:
            names = ", ".join(t.name for t in f.tensors[:6]) + (", ..." if f.count > 6 else "")
            lines.append(f"note: {f.where}: {_count(f)} differ across ranks ({names}): {f.hint}")
    if audited.sharded_state:
        held = ", ".join(f"{name} {n}" for name, n in audited.sharded_state.items())
        lines.append(f"note: optimizer state sharded by design, each rank holding its own part "
                     f"({held} entries): not compared across ranks; the parameters it updates "
                     "are, at every audited step")  # fmt: skip
    lines += _joined(audited)
    lines += [f"note: {text}" for text in untrained(audited)]
    lines.append(_recorded_alone(audited) if recorded_alone else _summary(audited))
    if audited.stopped:  # (an error of the audit's own; or, agreed, why every rank stopped)
        said = audited.stopped.startswith("the audit stopped")
        lines.append(f"note: {'' if said else 'the audit stopped early: '}{audited.stopped}")
    return lines


def verdict_line(report: AuditReport | None, verdict: str) -> str:
    if report is not None and report.faults:
        first = report.faults[0]
        return f"REPLICAS DIVERGED: first at {first.where}"
    if verdict == NOTHING_AUDITED:
        why = ("the audit stopped before its first step (see the note)"
               if report is not None and report.stopped
               else "no optimizer step ran in a process group of 2 or more ranks")  # fmt: skip
        return f"NOTHING AUDITED: {why}, so nothing was checked (exit 2, not a pass)"
    if verdict == AUDIT_STOPPED:
        why = "see the note" if report.stopped else (
            f"the ranks' reports end after {report.audited_steps} audited steps, before the "
            "script did: they could not be written (see the ranks' output)"
        )  # fmt: skip
        return (f"AUDIT STOPPED ({why}): the replicas were bitwise identical at every step "
                "audited before it; the steps after it were not checked (exit 2, not a pass)")  # fmt: skip
    if verdict == "pass":
        kept = any(not f.fault for f in report.findings)
        return (
            "replicas bitwise identical at every audited step"
            + (" (apart from the buffers noted, kept per rank by design)" if kept else "")
            + (" until the audit stopped (see the note)" if report.stopped else "")
            + (", but nothing trained (see the note)" if untrained(report) else "")
        )
    return f"verdict: {verdict}"


def untrained(report: AuditReport) -> list[str]:
    """What trained nothing (`AuditReport.zero_gradients`, `unchanged`), as notes: one for
    the whole run when no optimizer trained, else one for each kind of stillness."""
    zero, still = set(report.zero_gradients), set(report.unchanged)
    every = set(report.steps) or zero | still
    if every and (zero >= every or still >= every):
        return [nothing_trained(zero >= every, still >= every)]
    notes = []
    for labels, z, u in ((zero & still, True, True), (zero - still, True, False),
                         (still - zero, False, True)):  # fmt: skip
        if labels:
            notes.append(nothing_trained(z, u, ", ".join(sorted(labels))))
    return notes


def _block(f: Finding, title: str) -> list[str]:
    if f.kind == "layout":
        return [f"{title}: {f.where}: {f.detail}{_again(f)}", f"  what it usually means: {f.hint}"]
    described = [t for t in f.tensors if t.ranks or t.values]
    lines = [f"{title}: {f.where}: {_count(f)} differ{'s' if f.count == 1 else ''}"]
    lines += [f"  {t.describe()}" for t in described]
    rest = [t.name for t in f.tensors if not (t.ranks or t.values)]
    if rest:
        more = ", ..." if f.count > len(f.tensors) else ""
        lines.append(f"  also {', '.join(rest)}{more} ({f.count} in all)")
    if f.seen_at:
        lines.append(f"  seen again at step{'s' if len(f.seen_at) > 1 else ''} "
                     f"{', '.join(map(str, f.seen_at))}")  # fmt: skip
    lines.append(f"  what it usually means: {f.hint}")
    return lines


def _count(f: Finding) -> str:
    noun = "setting" if f.phase == SETTINGS else "tensor"
    return f"{f.count} {noun}{'s' if f.count != 1 else ''}"


def _again(f: Finding) -> str:
    return (
        f" (again at step{'s' if len(f.seen_at) > 1 else ''} {', '.join(map(str, f.seen_at))})"
        if f.seen_at
        else ""
    )


def _joined(report: AuditReport) -> list[str]:
    """The steps taken under PyTorch's join() that not every rank took: said, not audited."""
    lines = []
    if report.joined:
        steps = ", ".join(f"{_plural(n, 'step')} of {name}" for name, n in report.joined.items())
        still, of = report.joined_ranks or (0, 0)
        lines.append(
            f"note: uneven data under join(): {steps} taken after a rank had run out of data "
            f"and joined (down to {still} of {of} ranks still training): not audited, as only "
            "some ranks take them (join() shadows the collectives of the others); every step "
            "all ranks took was"
        )
    if report.unseen:
        steps = ", ".join(f"{_plural(n, 'step')} of {name}" for name, n in report.unseen.items())
        lines.append(
            f"note: {steps} inside a join() whose count of the ranks still training comes too "
            "late for the audit's point before a step (a join() led by an optimizer: put the "
            "model first, Join([model, optimizer])) or covers only part of the world (a join() "
            "over a subgroup): not audited"
        )
    return lines


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _recorded_alone(report: AuditReport) -> str:
    steps = ", ".join(f"{name} {_plural(n, 'step')}" for name, n in report.steps.items())
    return (f"one rank: no replicas to compare across ranks; the script took "
            f"{steps or 'no optimizer step'}, each recorded")  # fmt: skip


def _summary(report: AuditReport) -> str:
    steps = ", ".join(f"{name} {_plural(n, 'step')}" for name, n in report.steps.items())
    text = (f"audited: {_plural(report.audited_steps, 'step')} ({_plural(report.audits, 'point')}: before and after "
            f"each; the optimizer state every {STATE_EVERY}th audited step and wherever the "
            f"parameters differ), up to "
            f"{report.tensors} tensors and settings each; the script took {steps or 'no optimizer step'}")  # fmt: skip
    if steps and not report.finished:
        # as of the last report the ranks wrote: a killed run's (a hang, the deadline) or one
        # whose reports could not be written (a full disk), whose training went on after it
        text += " up to its ranks' last report"
    if report.sharded:
        text += f"; {report.sharded} sharded tensors never compared across ranks"
    if report.audited_steps:
        per = report.seconds / report.audited_steps * 1e3
        text += f"; the audit took {report.seconds:.2f}s on one rank ({per:.1f} ms a step)"
    return text
