"""The CLI table: every subcommand, its options, what runs it and what prints it.

Adding a command is adding a row; its flags come from its options dataclass
(`verify/options.py`). A row names its modules as strings (`command.py`): nothing here imports
a checker, so `list` and `--help` stay light. A measurement's verdict is "pass" when every
rank finished, whatever the numbers (a missed bar is reported, not an error), "fault" when a
rank failed and "timeout" when the time ran out (`perf/base.py`). The tool's measurements of
its own costs are not commands: they are a maintainer's scripts, `benchmarks/`.
"""

from __future__ import annotations

from verify.cli.command import Command


def _hang_fixed(args) -> dict:
    """Under --json, a script's output is echoed on stderr: stdout holds the JSON alone."""
    return {"console": "stderr" if args.json else "stdout"}


CHECK_COMMANDS: tuple[Command, ...] = (
    Command(
        "consistency",
        "are replicas bitwise identical at every step?",
        "verify.checks.consistency:ConsistencyOptions",
        "verify.checks.consistency:check_consistency",
        "verify.cli.text_checks:consistency",
    ),
    Command(
        "equivalence",
        "do gradients and parameters match one process on the global batch?",
        "verify.checks.equivalence:EquivalenceOptions",
        "verify.checks.equivalence:check_equivalence",
        "verify.cli.text_checks:equivalence",
    ),
    Command(
        "matrix",
        "certify: every check on every behaviour, one pass/fail table",
        "verify.checks.matrix:MatrixOptions",
        "verify.checks.matrix:run_matrix",
        "verify.cli.text_matrix:matrix",
    ),
    Command(
        "faults",
        "the detection matrix: is every faulty:<name> caught by its check?",
        "verify.checks.detection:DetectionOptions",
        "verify.checks.detection:detect",
        "verify.cli.text_matrix:detection",
    ),
    Command(
        "hang",
        "run under the hang watchdog: diagnose hangs and desyncs",
        "verify.checks.script_options:HangOptions",
        "verify.cli.head_start:hang",
        "verify.cli.text_checks:hang",
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
        "verify.checks.script_options:AuditOptions",
        "verify.cli.head_start:audit",
        "verify.cli.text_compare:audit",  # text_audit's, plus --record/--against's lines
        script=True,
        fixed=_hang_fixed,
        report="report",
    ),
    Command(
        "compare",
        "compare two recordings of audit --record step by step: where does B depart from A?",
        "verify.checks.compare:CompareOptions",
        "verify.checks.drill:run_compare",
        "verify.cli.text_compare:compare",
        positional="recordings",
    ),
    Command(
        "list", "list implementations and workloads", None, None, "verify.cli.text_list:listing"
    ),
    Command(
        "clean",
        "remove all but the newest N run folders under profiles/ (or --out)",
        "verify.runs:CleanOptions",
        "verify.runs:prune",
        "verify.cli.text_matrix:cleaned",
    ),
)

PERF_COMMANDS: tuple[Command, ...] = (
    Command(
        "profile",
        "profile variants; traces for TensorBoard / Perfetto",
        "verify.perf.profiling:ProfileOptions",
        "verify.perf.profiling:run_profile",
        "verify.cli.text_perf:profile",
        report="summary",
    ),
    Command(
        "bench",
        "step time of every variant vs torch-ddp / torch-zero / torch-fsdp; memory per rank vs 1/N",
        "verify.perf.bench:BenchOptions",
        "verify.perf.bench:run_bench",
        "verify.cli.text_bench:bench",
        report="bench",
    ),
    Command(
        "comm",
        "collective bandwidth, alpha-beta fit, best bucket size",
        "verify.perf.comm:CommOptions",
        "verify.perf.comm:run_comm",
        "verify.cli.text_perf:comm",
        report="comm",
    ),
    Command(
        "scaling",
        "throughput at world sizes 1..N",
        "verify.perf.scaling:ScalingOptions",
        "verify.perf.scaling:run_scaling",
        "verify.cli.text_perf:scaling",
        report="scaling",
    ),
    Command(
        "train",
        "train end to end; loss curves vs a single process",
        "verify.perf.train:TrainOptions",
        "verify.perf.train:run_training",
        "verify.cli.text_perf:train",
        report="train",
    ),
)


#: The tool's measurements of itself, once commands, now a maintainer's scripts: typing the old
#: command gets one line naming the script (same flags), not argparse's "invalid choice".
MOVED = {
    "bench-audit": "benchmarks/audit_cost.py",
    "bench-tracer": "benchmarks/tracer_cost.py",
    "bench-sanitize": "benchmarks/sanitize_cost.py",
}


def all_commands() -> tuple[Command, ...]:
    return CHECK_COMMANDS + PERF_COMMANDS
