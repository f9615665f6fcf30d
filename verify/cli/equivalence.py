"""`python -m verify equivalence`: parse, run `check_equivalence`, print, set the exit code.

Same forms as `consistency`: a table (here: every tensor's worst error against its tolerance),
a one-line verdict, or `--json`; exit 0 pass, 1 fault, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math

from tabulate import tabulate

from verify.checks.equivalence import (
    OPTIMIZERS,
    EquivalenceOptions,
    EquivalenceResult,
    TensorError,
    check_equivalence,
)
from verify.cli import (
    EXIT_FAULT,
    EXIT_PASS,
    _is_reporting_rank,
    _positive_float,
    _positive_int,
    add_common,
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "equivalence", help="do gradients and parameters match one process on the global batch?"
    )
    add_common(p)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--lr", type=_positive_float("--lr"), default=1e-3)
    p.add_argument(
        "--accumulate",
        type=_positive_int("--accumulate"),
        default=1,
        help="micro-batches per step, all but the last under no_sync()",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="zero_grad(set_to_none=False) instead of setting gradients to None",
    )
    p.add_argument("--no-scheduler", action="store_true", help="no StepLR after each step")
    p.add_argument(
        "--no-round-trip", action="store_true", help="no optimizer state_dict round trip midway"
    )
    p.set_defaults(run=cmd_equivalence)


def cmd_equivalence(args: argparse.Namespace) -> int:
    options = EquivalenceOptions(
        impl=args.impl,
        world_size=args.world_size,
        steps=args.steps,
        workload=args.workload,
        bucket_mb=args.bucket_mb,
        model_size_m=args.model_size,
        timeout_s=args.timeout,
        backend=args.backend,
        optimizer=args.optimizer,
        lr=args.lr,
        accumulate=args.accumulate,
        set_to_none=not args.keep_grads,
        scheduler=not args.no_scheduler,
        round_trip=not args.no_round_trip,
    )
    result = check_equivalence(options)
    if _is_reporting_rank():
        if args.json:
            print(json.dumps(result.to_dict(), indent=2, default=str))
        else:
            print(format_equivalence(result))
    return EXIT_PASS if result.passed else EXIT_FAULT


def format_equivalence(result: EquivalenceResult) -> str:
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
        lines.append(tabulate(rows, headers=headers, disable_numparse=True))
        lines.append("")
    if result.failure:
        lines.append(result.failure)
        lines.append("")
    if report is not None:
        lines += [f"note: {note}" for note in report.notes]
    lines.append(f"{result.verdict}  ({result.elapsed_s:.1f}s)")
    return "\n".join(lines)


def _row(e: TensorError) -> list[str]:
    """A tensor's worst check (largest error/tolerance over steps and ranks) as a table row."""
    if e.ratio == 0:  # no element differed at any step, on any rank
        if e.detail:  # "None in both": no gradient in any step, here or in one process
            return [e.kind, e.tensor, "-", "-", "-", "-", "-", e.detail]
        return [e.kind, e.tensor, "0", "0", "-", "0", "-", "bitwise equal"]
    where = "construction" if e.step == 0 else f"step {e.step}"
    return [
        e.kind,
        e.tensor,
        _num(e.max_abs),
        _num(e.max_rel),
        _num(e.tolerance),
        _num(e.ratio, ".2f"),
        f"{where}, rank {e.rank}",
        e.detail or ("ok" if e.passed else "OVER"),
    ]


def _num(value: float, spec: str = ".3g") -> str:
    return f"{value:{spec}}" if math.isfinite(value) else "-"
