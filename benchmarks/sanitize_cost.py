"""`python benchmarks/sanitize_cost.py`: what `--sanitize` (the race sanitizer) costs a
training step; with `--matrix`, a whole certification matrix (`benchmarks/bench_sanitize.py`).

A maintainer's measurement of the tool itself (benchmarks/README.md), once the command
`python -m verify bench-sanitize`: the same flags (`--help`), the same report, the same exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout it sits in is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.cli import main as run_command  # noqa: E402
from verify.cli.command import Command  # noqa: E402

COMMAND = Command(
    "bench-sanitize",
    "benchmark --sanitize (the race sanitizer) against a training step",
    "benchmarks.bench_sanitize:SanitizeBenchOptions",
    "benchmarks.bench_sanitize:run_sanitize_bench",
    "benchmarks.text_costs:sanitize",
)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement with the flags in `argv` (default: the command line); the exit code."""
    return run_command(argv, alone=COMMAND, prog="python benchmarks/sanitize_cost.py")


if __name__ == "__main__":
    sys.exit(main())
