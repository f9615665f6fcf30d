"""`python benchmarks/record_cost.py`: what `audit --record` adds to an audited training step
(goal: at most 2%), what recording the batch adds to it (goal: at most 0.5%), and the size
of a recording projected for a 100M-parameter model over 1,000 steps (goal: at most 100 MB)
(`benchmarks/bench_record.py`).

A maintainer's measurement of the tool itself (benchmarks/README.md): the flags of
`bench-audit` (`--model-size`, `--local-batch`, `--repeats`, ...), `--help`, `--json`, the
same exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout it sits in is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.cli import main as run_command  # noqa: E402
from verify.cli.command import Command  # noqa: E402

COMMAND = Command(
    "bench-record",
    "benchmark audit --record: recorded / audited training step, and a recording's size",
    "benchmarks.bench_record:RecordBenchOptions",
    "benchmarks.bench_record:run_record_bench",
    "benchmarks.text_costs:record_cost",
)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement with the flags in `argv` (default: the command line); the exit code."""
    return run_command(argv, alone=COMMAND, prog="python benchmarks/record_cost.py")


if __name__ == "__main__":
    sys.exit(main())
