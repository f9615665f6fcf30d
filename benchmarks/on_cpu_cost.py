"""`python benchmarks/on_cpu_cost.py`: what `--on-cpu` (rehearsing a CUDA script on CPU ranks,
`verify/oncpu/`) adds to a training step (`benchmarks/bench_on_cpu.py`).

A maintainer's measurement of the tool itself (benchmarks/README.md), with the flags
(`--help`), report and exit codes of the measurement commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout it sits in is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.cli import main as run_command  # noqa: E402
from verify.cli.command import Command  # noqa: E402

COMMAND = Command(
    "bench-on-cpu",
    "benchmark what --on-cpu adds to a training step",
    "benchmarks.bench_on_cpu:OnCpuBenchOptions",
    "benchmarks.bench_on_cpu:run_on_cpu_bench",
    "benchmarks.text_costs:on_cpu",
)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement with the flags in `argv` (default: the command line); the exit code."""
    return run_command(argv, alone=COMMAND, prog="python benchmarks/on_cpu_cost.py")


if __name__ == "__main__":
    sys.exit(main())
