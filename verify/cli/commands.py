"""The CLI table: every subcommand, its options, what runs it and what prints it.

Adding a command is adding a row; its flags come from its options dataclass
(`verify/options.py`). A measurement's verdict is "pass" when every rank finished, whatever
the numbers (a missed bar is reported, not an error), "fault" when a rank failed and
"timeout" when the time ran out (`perf/base.py`).
"""

from __future__ import annotations

from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.detection import DetectionOptions, detect
from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.hang import HangOptions, check_hang
from verify.checks.matrix import MatrixOptions, run_matrix
from verify.checks.script_audit import AuditOptions, check_audit
from verify.cli import text_audit, text_bench, text_checks, text_costs, text_matrix, text_perf
from verify.cli.command import Command
from verify.perf.bench import BenchOptions, run_bench
from verify.perf.bench_audit import AuditBenchOptions, run_audit_bench
from verify.perf.bench_sanitize import SanitizeBenchOptions, run_sanitize_bench
from verify.perf.bench_tracer import TracerBenchOptions, run_tracer_bench
from verify.perf.comm import CommOptions, run_comm
from verify.perf.profiling import ProfileOptions, run_profile
from verify.perf.scaling import ScalingOptions, run_scaling
from verify.perf.train import TrainOptions, run_training
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
        report="report",
    ),
    Command(
        "audit",
        "run your script; find the first step and tensor where replicas disagree",
        AuditOptions,
        check_audit,
        text_audit.audit,
        script=True,
        fixed=_hang_fixed,
        report="report",
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

PERF_COMMANDS: tuple[Command, ...] = (
    Command(
        "profile",
        "profile variants; traces for TensorBoard / Perfetto",
        ProfileOptions,
        run_profile,
        text_perf.profile,
        report="summary",
    ),
    Command(
        "bench",
        "step time of every variant vs torch-ddp / torch-zero / torch-fsdp; memory per rank vs 1/N",
        BenchOptions,
        run_bench,
        text_bench.bench,
        report="bench",
    ),
    Command(
        "comm",
        "collective bandwidth, alpha-beta fit, best bucket size",
        CommOptions,
        run_comm,
        text_perf.comm,
        report="comm",
    ),
    Command(
        "scaling",
        "throughput at world sizes 1..N",
        ScalingOptions,
        run_scaling,
        text_perf.scaling,
        report="scaling",
    ),
    Command(
        "train",
        "train end to end; loss curves vs a single process",
        TrainOptions,
        run_training,
        text_perf.train,
        report="train",
    ),
    Command(
        "bench-audit",
        "benchmark the audit against an all-gather and a training step",
        AuditBenchOptions,
        run_audit_bench,
        text_costs.audit,
    ),
    Command(
        "bench-tracer",
        "benchmark the collective tracer against a training step",
        TracerBenchOptions,
        run_tracer_bench,
        text_costs.tracer,
    ),
    Command(
        "bench-sanitize",
        "benchmark --sanitize (the race sanitizer) against a training step",
        SanitizeBenchOptions,
        run_sanitize_bench,
        text_costs.sanitize,
    ),
)


def all_commands() -> tuple[Command, ...]:
    return CHECK_COMMANDS + PERF_COMMANDS
