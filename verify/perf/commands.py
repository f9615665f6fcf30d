"""The measurement commands' rows of the CLI table (profile, bench, comm, scaling, train,
bench-audit, bench-tracer)."""

from __future__ import annotations

from verify.cli.command import Command

PERF_COMMANDS: tuple[Command, ...] = ()
