"""`python -m verify matrix` (the certification run) and `python -m verify faults` (the
detection matrix). Parse, run `matrix.py`, print, set the exit code; nothing is decided here.
"""

from __future__ import annotations

import argparse
import json

from tabulate import tabulate

from verify.checks.matrix import (
    BEHAVIOUR,
    CERTIFIED,
    CHECKS,
    DetectionResult,
    MatrixOptions,
    MatrixResult,
    run_detection,
    run_matrix,
)
from verify.cli import EXIT_FAULT, EXIT_PASS, _is_reporting_rank, _positive_float, impl_help

SYMBOL = {"pass": "ok", "fail": "FAIL", "not claimed": "not claimed", "n/a": "n/a"}
COMPACT = {"pass": "✓", "fail": "✗", "not claimed": "–", "n/a": "·"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "matrix", help="certify: every check on every behaviour, one pass/fail table"
    )
    p.add_argument(
        "--impl",
        action="append",
        required=True,
        help=impl_help() + "; repeat it, or 'all' for the built-ins and the PyTorch references",
    )
    p.add_argument(
        "--rows",
        default="",
        help=f"comma-separated behaviours (default: all): {', '.join(BEHAVIOUR)}",
    )
    p.add_argument(
        "--checks", default=",".join(CHECKS), help=f"comma-separated, among {', '.join(CHECKS)}"
    )
    p.add_argument(
        "--timeout", type=_positive_float("--timeout"), default=600.0, help="seconds per launch"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=cmd_matrix)

    p = subparsers.add_parser(
        "faults", help="the detection matrix: is every faulty:<name> caught by its check?"
    )
    p.add_argument(
        "--fault", action="append", default=[], help="faulty:<name> (repeatable; default: all)"
    )
    p.add_argument(
        "--no-controls",
        action="store_true",
        help="skip running the built-ins and references on the same behaviours",
    )
    p.add_argument(
        "--timeout", type=_positive_float("--timeout"), default=600.0, help="seconds per launch"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=cmd_faults)


def _split(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def cmd_matrix(args: argparse.Namespace) -> int:
    impls = tuple(n for name in args.impl for n in (CERTIFIED if name == "all" else (name,)))
    options = MatrixOptions(
        impls=tuple(dict.fromkeys(impls)),
        rows=_split(args.rows),
        checks=_split(args.checks),
        timeout_s=args.timeout,
    )
    result = run_matrix(options)
    if _is_reporting_rank():
        print(json.dumps(result.to_dict(), indent=2) if args.json else format_matrix(result))
    return EXIT_PASS if result.passed else EXIT_FAULT


def format_matrix(result: MatrixResult) -> str:
    o = result.options
    behaviours = o.behaviours
    if len(o.impls) == 1:
        (impl,) = o.impls
        checks = result.checks_for(impl)
        rows = [
            [b.title, *(SYMBOL[result.result(impl, b.key, c).status] for c in checks)]
            for b in behaviours
        ]
        table = tabulate(rows, headers=["behaviour", *checks])
        lines = [f"certification matrix: {impl}", "", table]
    else:
        header = "cell: " + ", ".join(c for c in o.checks)
        rows = [
            [
                b.title,
                *(
                    "".join(
                        COMPACT[result.result(i, b.key, c).status] for c in result.checks_for(i)
                    )
                    for i in o.impls
                ),
            ]
            for b in behaviours
        ]
        legend = (
            "✓ pass  ✗ fail  – not claimed  · n/a   (the shard check for sharded optimizers only)"
        )
        table = tabulate(rows, headers=["behaviour", *o.impls])
        lines = [f"certification matrix ({header})", "", table, "", legend]
    failures = [(k, r) for k, r in result.results.items() if r.failed]
    if failures:
        lines += ["", "failures:"]
        for (impl, key, check), r in failures:
            where = f"{BEHAVIOUR[key].title} / {check}"
            where = where if len(o.impls) == 1 else f"{impl} / {where}"
            lines.append(f"  {where}: {r.headline}")
    claims = sorted(
        {(i, r.detail) for (i, _, _), r in result.results.items() if r.status == "not claimed"}
    )
    if claims:
        lines += ["", "not claimed:"]
        lines += [f"  {why}" if len(o.impls) == 1 else f"  {i}: {why}" for i, why in claims]
    counts = _counts(result)
    verdict = "FAULT" if failures else "PASS"
    lines += [
        "",
        f"{verdict}: {counts}  ({result.elapsed_s:.0f}s, {result.launches} launch"
        f"{'es' if result.launches != 1 else ''})",
    ]
    return "\n".join(lines)


def _counts(result: MatrixResult) -> str:
    """Cells by status, over the columns shown (no shard column for DDP wrappers)."""
    statuses = [r.status for (i, _, c), r in result.results.items() if c in result.checks_for(i)]
    parts = [f"{statuses.count(s)} {s}" for s in ("pass", "fail", "not claimed", "n/a")]
    return ", ".join(p for p in parts if not p.startswith("0 "))


def cmd_faults(args: argparse.Namespace) -> int:
    controls = () if args.no_controls else CERTIFIED
    result = run_detection(tuple(args.fault), controls=controls, timeout_s=args.timeout)
    if _is_reporting_rank():
        print(json.dumps(result.to_dict(), indent=2) if args.json else format_detection(result))
    return EXIT_PASS if result.passed else EXIT_FAULT


def format_detection(result: DetectionResult) -> str:
    rows = []
    for d in result.detections:
        cells = [_detected(d.checks[c]) if c in d.checks else "-" for c in CHECKS]
        rows.append(
            [d.name, ", ".join(d.shows_on), *cells, d.caught_by, "yes" if d.caught else "NO"]
        )
    headers = ["faulty implementation", "behaviour", *CHECKS, "must be caught by", "caught"]
    lines = ["detection matrix", "", tabulate(rows, headers=headers), "", "how each was caught:"]
    for d in result.detections:
        check = d.caught_by
        lines.append(f"  {d.name} ({check}, {d.where[check]}): {d.checks[check].headline}")
    lines.append("")
    missed = [d.name for d in result.detections if not d.caught]
    if missed:
        lines.append(f"NOT CAUGHT by their check: {', '.join(missed)}")
    if result.controls:
        flagged = result.false_alarms
        n = len(result.controls)
        if flagged:
            lines.append(f"correct implementations FLAGGED ({len(flagged)} cells):")
            for (impl, key, check), r in flagged:
                lines.append(f"  {impl} / {key} / {check}: {r.headline}")
        else:
            lines.append(
                f"controls: {', '.join(result.controls)} pass every check on the same "
                f"behaviours ({n} implementations, none flagged)"
            )
    verdict = "PASS" if result.passed else "FAULT"
    caught = sum(d.caught for d in result.detections)
    lines.append(
        f"{verdict}: {caught}/{len(result.detections)} faulty implementations caught by their "
        f"check  ({result.matrix.elapsed_s:.0f}s, {result.matrix.launches} launches)"
    )
    return "\n".join(lines)


def _detected(r) -> str:
    return {"fail": "FAULT", "pass": "pass"}.get(r.status, r.status)
