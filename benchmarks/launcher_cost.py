"""`python benchmarks/launcher_cost.py`: what `audit -- torchrun ...` adds to a run's wall
time over the same script under `audit --nproc 2` (`benchmarks/bench_launcher.py`).

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
    "bench-launcher",
    "benchmark the launcher form (audit -- torchrun ...) against audit --nproc 2",
    "benchmarks.bench_launcher:LauncherBenchOptions",
    "benchmarks.bench_launcher:run_launcher_bench",
    "benchmarks.bench_launcher:text",
)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement with the flags in `argv` (default: the command line); the exit code."""
    return run_command(argv, alone=COMMAND, prog="python benchmarks/launcher_cost.py")


if __name__ == "__main__":
    sys.exit(main())
