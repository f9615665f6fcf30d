"""`python benchmarks/audit_cost.py`: what the per-step audit costs, against an all-gather of
the same tensors and a training step; with `--script-audit`, what `audit --nproc`'s step hooks
add to a step (`benchmarks/bench_audit.py`).

A maintainer's measurement of the tool itself (benchmarks/README.md), once the command
`python -m verify bench-audit`: the same flags (`--help`), the same report, the same exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout it sits in is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.cli import main as run_command  # noqa: E402
from verify.cli.command import Command  # noqa: E402

COMMAND = Command(
    "bench-audit",
    "benchmark the audit against an all-gather and a training step",
    "benchmarks.bench_audit:AuditBenchOptions",
    "benchmarks.bench_audit:run_audit_bench",
    "benchmarks.text_costs:audit",
)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement with the flags in `argv` (default: the command line); the exit code."""
    return run_command(argv, alone=COMMAND, prog="python benchmarks/audit_cost.py")


if __name__ == "__main__":
    sys.exit(main())
