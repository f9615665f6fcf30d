"""`python -m verify audit --nproc N -- train.py ARGS`: run a user's script unmodified, as
`hang --nproc N` does (the same path, `checks/script.py`: the watchdog, the streamed output,
the report folder, `--sanitize`), and audit at every optimizer step that every tensor meant
to be replicated is bitwise identical on every rank (`verify/script_audit/`).

The verdict: "fault" when the audit found a divergence, or the run hung, desynced or crashed,
or `--sanitize` found a race; "timeout" when the deadline came first; "nothing audited"
(exit 2, not a pass: a CI gate must not pass on nothing checked) when the script ended well
without an optimizer step in a process group of 2 or more ranks; "audit stopped" (exit 2,
not a pass either) when the audit ended before the script did and had found nothing until
then (its report could not be written: the steps after it were never checked, and a fault
would say the user's training is wrong, which nothing showed); "pass" when the script ran
to the end with identical replicas (notes, such as buffers kept per rank by design or
optimizer state each rank holds its own share of, do not fail a run). The report folder holds each rank's `rank<r>.audit.json` beside the hang
report's files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from verify import runs
from verify.checks.script import ScriptRun, run_watched_script
from verify.checks.script_options import AuditOptions
from verify.checks.verdict import AUDIT_STOPPED, FAULT, NOTHING_AUDITED, PASS, Verdicted
from verify.launching.launcher import Started
from verify.script_audit import AuditReport, Finding


@dataclass(frozen=True)
class AuditResult(Verdicted):
    """The run (its diagnosis, report folder, races) and what the audit found."""

    options: AuditOptions
    run: ScriptRun

    @property
    def audit(self) -> AuditReport | None:
        return self.run.audit

    @property
    def findings(self) -> tuple[Finding, ...]:
        return self.audit.findings if self.audit is not None else ()

    @property
    def faults(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.fault)

    @property
    def report_dir(self) -> str:
        return self.run.report_dir

    @property
    def verdict(self) -> str:
        if self.faults:
            return FAULT
        verdict = self.run.watched_verdict
        if verdict == PASS and (self.audit is None or self.audit.audits == 0):
            return NOTHING_AUDITED
        if verdict == PASS and (self.audit.stopped or not self.audit.finished):
            return AUDIT_STOPPED  # every rank ended well, its report did not (`stopped_line`)
        return verdict

    def to_dict(self) -> dict:
        return {
            "check": "audit",
            "verdict": self.verdict,
            "passed": self.passed,
            "options": asdict(self.options),
            "audit": None if self.audit is None else self.audit.to_dict(),
            **self.run.watched_dict(),
        }


def check_audit(options: AuditOptions, started: Started | None = None) -> AuditResult:
    """Run the script under the watchdog with the audit on; write and return the report.
    `started`: the launcher command the CLI started already (`verify/cli/head_start.py`)."""
    run = run_watched_script(
        options, command="audit", audit_every=options.audit_every, record=options.recording,
        started=started,
    )  # fmt: skip
    result = AuditResult(options, run)
    runs.save_report(run.report_dir, result.to_dict())
    if options.recording:  # --record DIR / --against DIR (verify/checks/compare.py)
        from verify.checks.compare import with_recording

        return with_recording(result)
    return result


__all__ = ["AuditOptions", "AuditResult", "check_audit"]
