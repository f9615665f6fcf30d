"""Launching: every multi-process run goes through here (see `spawn.py`)."""

from verify.launching.spawn import (
    DEFAULT_STALL_TIMEOUT_S,
    STALL_ENV,
    LaunchResult,
    RankContext,
    RankOutcome,
    launch,
)

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "STALL_ENV",
    "LaunchResult",
    "RankContext",
    "RankOutcome",
    "launch",
]
