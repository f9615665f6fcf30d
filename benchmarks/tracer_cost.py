"""`python benchmarks/tracer_cost.py`: what the collective tracer adds to a training step
(`benchmarks/bench_tracer.py`).

A maintainer's measurement of the tool itself (benchmarks/README.md), once the command
`python -m verify bench-tracer`: the same flags (`--help`), the same report, the same exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout it sits in is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.cli import main as run_command  # noqa: E402
from verify.cli.command import Command  # noqa: E402

COMMAND = Command(
    "bench-tracer",
    "benchmark the collective tracer against a training step",
    "benchmarks.bench_tracer:TracerBenchOptions",
    "benchmarks.bench_tracer:run_tracer_bench",
    "benchmarks.text_costs:tracer",
)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement with the flags in `argv` (default: the command line); the exit code."""
    return run_command(argv, alone=COMMAND, prog="python benchmarks/tracer_cost.py")


if __name__ == "__main__":
    sys.exit(main())
