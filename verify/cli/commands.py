"""The CLI table: every subcommand, its options, what runs it and what prints it.

Adding a command is adding a row; its flags come from its options dataclass
(`verify/options.py`). The measurement commands' rows live with them (`verify/perf/`).
"""

from __future__ import annotations

from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.detection import DetectionOptions, detect
from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.hang import HangOptions, check_hang
from verify.checks.matrix import MatrixOptions, run_matrix
from verify.checks.script_audit import AuditOptions, check_audit
from verify.cli import text_audit, text_checks, text_matrix
from verify.cli.command import Command
from verify.runs import CleanOptions, prune


def _hang_fixed(args) -> dict:
    """Under --json, a script's output is echoed on stderr: stdout holds the JSON alone."""
    return {"console": "stderr" if args.json else "stdout"}


CHECK_COMMANDS: tuple[Command, ...] = (
    Command(
        "consistency",
        "are replicas bitwise identical at every step?",
        ConsistencyOptions,
        check_consistency,
        text_checks.consistency,
    ),
    Command(
        "equivalence",
        "do gradients and parameters match one process on the global batch?",
        EquivalenceOptions,
        check_equivalence,
        text_checks.equivalence,
    ),
    Command(
        "matrix",
        "certify: every check on every behaviour, one pass/fail table",
        MatrixOptions,
        run_matrix,
        text_matrix.matrix,
    ),
    Command(
        "faults",
        "the detection matrix: is every faulty:<name> caught by its check?",
        DetectionOptions,
        detect,
        text_matrix.detection,
    ),
    Command(
        "hang",
        "run under the hang watchdog: diagnose hangs and desyncs",
        HangOptions,
        check_hang,
        text_checks.hang,
        conflicts=(
            ("scenarios", "impl"),
            ("scenarios", "nproc"),
            ("impl", "nproc"),
            ("nproc", "world_size"),
            ("scenarios", "steps"),
        ),
        script=True,
        fixed=_hang_fixed,
    ),
    Command(
        "audit",
        "run your script; find the first step and tensor where replicas disagree",
        AuditOptions,
        check_audit,
        text_audit.audit,
        script=True,
        fixed=_hang_fixed,
    ),
    Command(
        "list", "list implementations and workloads", None, lambda _: None, text_matrix.listing
    ),  # fmt: skip
    Command(
        "clean",
        "remove all but the newest N run folders under profiles/ (or --out)",
        CleanOptions,
        prune,
        text_matrix.cleaned,
    ),
)


def all_commands() -> tuple[Command, ...]:
    from verify.perf.commands import PERF_COMMANDS

    return CHECK_COMMANDS + PERF_COMMANDS
