"""The measurement commands' rows of the CLI table (`verify/cli/command.py`).

Each row: the command, its options dataclass (its flags come from the fields), the function
that runs it and returns a result, and the function that turns the result into text. A
measurement's verdict is "pass" when every rank finished, whatever the numbers (a missed bar
is reported, not an error), "fault" when a rank failed and "timeout" when the time ran out.
"""

from __future__ import annotations

from verify.cli.command import Command
from verify.perf import text, text_bench, text_costs
from verify.perf.bench import BenchOptions, run_bench
from verify.perf.bench_audit import AuditBenchOptions, run_audit_bench
from verify.perf.bench_sanitize import SanitizeBenchOptions, run_sanitize_bench
from verify.perf.bench_tracer import TracerBenchOptions, run_tracer_bench
from verify.perf.comm import CommOptions, run_comm
from verify.perf.profiling import ProfileOptions, run_profile
from verify.perf.scaling import ScalingOptions, run_scaling
from verify.perf.train import TrainOptions, run_training

PERF_COMMANDS: tuple[Command, ...] = (
    Command(
        "profile",
        "profile variants; traces for TensorBoard / Perfetto",
        ProfileOptions,
        run_profile,
        text.profile,
    ),
    Command(
        "bench",
        "step time of every variant vs torch-ddp / torch-zero / torch-fsdp; memory per rank vs 1/N",
        BenchOptions,
        run_bench,
        text_bench.bench,
    ),
    Command(
        "comm",
        "collective bandwidth, alpha-beta fit, best bucket size",
        CommOptions,
        run_comm,
        text.comm,
    ),
    Command("scaling", "throughput at world sizes 1..N", ScalingOptions, run_scaling, text.scaling),
    Command(
        "train",
        "train end to end; loss curves vs a single process",
        TrainOptions,
        run_training,
        text.train,
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
