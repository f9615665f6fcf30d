"""`python -m verify <check> ...`: parse, run a checker, print, set the exit code.

Exit codes (DESIGN.md): 0 the check passed; 1 the check found a fault (wrong result, hang,
desync, crashed rank); 2 the tool could not run the check (bad arguments, import error).
Nothing here decides a verdict: checkers return result dataclasses, this module formats them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable

from tabulate import tabulate

from impls.registry import DEFAULT_BUCKET_MB, REGISTRY, names
from impls.registry import ImplError as ImplError
from verify.training.workloads import WORKLOADS

EXIT_PASS, EXIT_FAULT, EXIT_USAGE = 0, 1, 2

# Feature modules that add their own subcommand: each defines
# `register(subparsers) -> None`, adding a parser whose `run(args) -> int` default is set.
# Keeping the list here (one line per feature) keeps `python -m verify --help` in one place.
EXTENSIONS: tuple[str, ...] = (
    "verify.cli.perf",  # profile, bench, comm, scaling, train
    "verify.checks.hang",  # hang, bench-tracer
    "verify.cli.equivalence",  # equivalence
    "verify.cli.matrix",  # matrix, faults
)


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(message)


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _positive_float(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value

    return parse


def impl_help() -> str:
    correct = ", ".join(names({"builtin", "reference"}))
    return f"a registered name ({correct}), package.module:Class, or path/to/file.py:Class"


def default_world_size() -> int:
    """2 ranks, or torchrun's WORLD_SIZE when this process is one of its ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 2


def add_common(p: argparse.ArgumentParser, *, workload: str = "mlp") -> None:
    p.add_argument("--impl", required=True, help=impl_help())
    p.add_argument(
        "--world-size",
        type=_positive_int("--world-size"),
        default=default_world_size(),
        help="ranks to spawn (default 2; under torchrun, its WORLD_SIZE)",
    )
    p.add_argument("--steps", type=_positive_int("--steps"), default=3)
    p.add_argument("--workload", choices=list(WORKLOADS), default=workload)
    p.add_argument(
        "--model-size",
        type=_positive_float("--model-size"),
        default=None,
        help="transformer workload: millions of parameters (default: a tiny GPT)",
    )
    p.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=DEFAULT_BUCKET_MB)
    p.add_argument("--timeout", type=_positive_float("--timeout"), default=120.0, help="seconds")
    p.add_argument(
        "--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: one GPU per rank"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m verify",
        description="Verify data-parallel training implementations.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("consistency", help="are replicas bitwise identical at every step?")
    add_common(p)
    p.set_defaults(run=cmd_consistency)
    p = sub.add_parser("list", help="list implementations and workloads")
    p.set_defaults(run=cmd_list)
    p = sub.add_parser(
        "bench-audit", help="benchmark the audit against an all-gather and a training step"
    )
    p.add_argument("--impl", default="bucketed", help=impl_help())
    p.add_argument("--world-size", type=_positive_int("--world-size"), default=2)
    p.add_argument("--model-size", type=_positive_float("--model-size"), default=50.0)
    p.add_argument("--repeats", type=_positive_int("--repeats"), default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_bench_audit)
    for name in EXTENSIONS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (UsageError, ValueError) as e:  # ImplError is a ValueError
        print(f"verify: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("verify: interrupted", file=sys.stderr)
        return 130


def _is_reporting_rank() -> bool:
    """Under torchrun every rank runs the CLI; only global rank 0 prints."""
    return int(os.environ.get("RANK", "0")) == 0


# --- consistency ---------------------------------------------------------------------------


def cmd_consistency(args: argparse.Namespace) -> int:
    from verify.checks.consistency import ConsistencyOptions, check_consistency

    options = ConsistencyOptions(
        impl=args.impl,
        world_size=args.world_size,
        steps=args.steps,
        workload=args.workload,
        bucket_mb=args.bucket_mb,
        model_size_m=args.model_size,
        timeout_s=args.timeout,
        backend=args.backend,
    )
    result = check_consistency(options)
    if _is_reporting_rank():
        if args.json:
            print(json.dumps(result.to_dict(), indent=2, default=str))
        else:
            print(format_consistency(result))
    return EXIT_PASS if result.passed else EXIT_FAULT


def format_consistency(result) -> str:
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
        lines.append(tabulate(rows, headers=["checkpoint", "tensors", "mismatched", "audit ms"]))
        lines.append("")
    if result.mismatches:
        rows = [
            [
                m.checkpoint,
                m.tensor,
                ",".join(map(str, m.ranks)),
                m.reference_rank,
                "-" if m.max_abs_diff is None else f"{m.max_abs_diff:.3g}",
                "-" if m.num_different is None else f"{m.num_different}/{m.numel}",
                "-" if m.first_index is None else str(list(m.first_index)),
                m.detail,
            ]
            for m in result.mismatches
        ]
        headers = ["checkpoint", "tensor", "ranks", "vs rank", "max |diff|", "differ", "first", ""]
        lines.append(tabulate(rows, headers=headers))
        lines.append("")
    if result.failure:
        lines.append(result.failure)
        lines.append("")
    for note in result.notes:
        lines.append(f"note: {note}")
    lines.append(f"{result.verdict}  ({result.elapsed_s:.1f}s)")
    return "\n".join(lines)


# --- list ----------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    rows = [[i.name, i.source, "yes" if i.sharded else "", i.summary] for i in REGISTRY.values()]
    print(tabulate(rows, headers=["implementation", "kind", "sharded", "what it does"]))
    print()
    rows = [[name, cls.summary] for name, cls in WORKLOADS.items()]
    print(tabulate(rows, headers=["workload", "what it exercises"]))
    return EXIT_PASS


# --- bench-audit ---------------------------------------------------------------------------


def cmd_bench_audit(args: argparse.Namespace) -> int:
    from verify.perf.bench_audit import AuditBenchOptions, format_audit_bench, run_audit_bench

    options = AuditBenchOptions(
        impl=args.impl,
        world_size=args.world_size,
        model_size_m=args.model_size,
        repeats=args.repeats,
    )
    result = run_audit_bench(options)
    if _is_reporting_rank():
        print(json.dumps(result.to_dict(), indent=2) if args.json else format_audit_bench(result))
    return EXIT_PASS if result.ok else EXIT_FAULT
