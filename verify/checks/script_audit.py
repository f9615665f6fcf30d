"""`python -m verify audit --nproc N -- train.py ARGS`: run a user's script unmodified, as
`hang --nproc N` does (the same path, `checks/script.py`: the watchdog, the streamed output,
the report folder, `--sanitize`), and audit at every optimizer step that every tensor meant
to be replicated is bitwise identical on every rank (`verify/script_audit/`).

The verdict: "fault" when the audit found a divergence, or the run hung, desynced or crashed,
or `--sanitize` found a race; "timeout" when the deadline came first; "nothing audited"
(exit 2, not a pass: a CI gate must not pass on nothing checked) when the script ended well
without an optimizer step in a process group of 2 or more ranks; "pass" when the script ran
to the end with identical replicas (notes, such as buffers kept per rank by design or
optimizer state each rank holds its own share of, do not fail a run). The report folder holds each rank's `rank<r>.audit.json` beside the hang
report's files.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from verify import runs
from verify.checks.script import ScriptRun, refuse_under_torchrun, run_watched_script
from verify.checks.verdict import FAULT, NOTHING_AUDITED, PASS, Verdicted
from verify.launching import DEFAULT_STALL_TIMEOUT_S
from verify.launching.command import is_command
from verify.options import OutputOptions, ThreadOptions, knob, refuse_on_cpu
from verify.script_audit import AuditReport, Finding


@dataclass(frozen=True, kw_only=True)
class AuditOptions(ThreadOptions, OutputOptions):
    """A script, its ranks, and how often to audit."""

    nproc: int = knob(2, "ranks to run the script in", minimum=1)
    script: tuple[str, ...] = knob((), "the script and its arguments, after --", cli=False)
    audit_every: int = knob(
        1, "audit every N-th optimizer step (steps 0, N, 2N, ...): less cost on large models",
        minimum=1,
    )  # fmt: skip
    stall_timeout_s: float = knob(
        DEFAULT_STALL_TIMEOUT_S, "seconds with no collective progress, while a rank waits and "
        "none works, that make a hang", flag="--stall-timeout", unit="s", positive=True,
    )  # fmt: skip
    timeout_s: float = knob(
        3600.0, "how long the script may run", flag="--timeout", unit="s", positive=True
    )
    backend: str = knob(
        "gloo", "the script's backend: gloo (CPU) or nccl (one GPU per rank); the audit "
        "itself always talks over a gloo group of its own", choices=("gloo", "nccl"),
    )  # fmt: skip
    sanitize: bool = knob(False, "also run the script under the race sanitizer (docs/races.md)")
    on_cpu: bool = knob(
        False, "rehearse a script written for CUDA on CPU ranks over gloo, unmodified: CUDA "
        "devices map to the CPU, nccl to gloo, and the report lists each call mapped "
        "(docs/audit.md)",
    )  # fmt: skip
    console: str = knob("stdout", "where a script's output is echoed", cli=False)
    # Two runs of a script compared step by step (verify/recording/, docs/compare.md).
    record: str | None = knob(None, "record every optimizer step into this new folder "
                              "(compare a later run with it: --against)")  # fmt: skip
    against: str | None = knob(None, "compare this run, step by step, with the recording in "
                               "this folder (written by --record): where it first departs")  # fmt: skip
    align_step: int | None = knob(None, "with --against: this run's step 0 is the recording's "
                                  "step K (default: found from the parameters)", minimum=0)  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_under_torchrun("audit", "audit_run", "docs/audit.md")
        if not self.script:
            raise ValueError(
                "audit needs a script or a command: audit --nproc N -- train.py ARGS, or "
                "audit -- torchrun ... train.py ARGS"
            )
        if not is_command(self.script) and not os.path.isfile(self.script[0]):
            raise ValueError(f"script {self.script[0]} does not exist")
        refuse_on_cpu(self.on_cpu, self.backend)
        if self.record or self.against or self.align_step is not None:
            from verify.recording.command import check_record_options

            check_record_options(self)


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


def check_audit(options: AuditOptions) -> AuditResult:
    """Run the script under the watchdog with the audit on; write and return the report."""
    recording = bool(options.record or options.against)
    if recording:
        from verify.recording.command import check_record_folders

        check_record_folders(options)
    run = run_watched_script(
        options, command="audit", audit_every=options.audit_every, record=recording
    )
    result = AuditResult(options, run)
    runs.write_json(Path(run.report_dir) / "report.json", result.to_dict())
    if recording:  # --record DIR / --against DIR (verify/recording/command.py)
        from verify.recording.command import with_recording

        return with_recording(result)
    return result


__all__ = ["AuditOptions", "AuditResult", "check_audit"]
