"""`python benchmarks/drill_cost.py`: what `compare --drill` costs: the drill-down of a 2-rank
run to the op level against the plain runs up to the departing step (goal: at most 3 times),
and against recorded runs when it departs at their last step (the capture costs nothing on
the steps before) (`benchmarks/bench_drill.py`).

A maintainer's measurement of the tool itself (benchmarks/README.md), with the flags, report
and exit codes of the other scripts here.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout it sits in is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.cli import main as run_command  # noqa: E402
from verify.cli.command import Command  # noqa: E402

COMMAND = Command(
    "bench-drill",
    "benchmark compare --drill: a drill-down / the plain runs up to the departing step",
    "benchmarks.bench_drill:DrillBenchOptions",
    "benchmarks.bench_drill:run_drill_bench",
    "benchmarks.bench_drill:text",
)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement with the flags in `argv` (default: the command line); the exit code."""
    return run_command(argv, alone=COMMAND, prog="python benchmarks/drill_cost.py")


if __name__ == "__main__":
    sys.exit(main())
