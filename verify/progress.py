"""Progress lines on stderr while a command runs: what runs, n of m.

Run functions call `say("matrix: cell 12/40: bucketed / no-sync / equivalence")`; the CLI
decides whether anyone hears it (`enable`): on for text output, off under `--json` unless
`--progress` asks for it, so a JSON document on stdout is never mixed with anything. A rank
says it with `verify.launching.rank.say`, which travels on the rank's report pipe and is
printed here once, by the parent (never once per rank, never replayed).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

_stream: TextIO | None = None
_lock = threading.Lock()
_start = time.monotonic()


def enable(stream: TextIO | None = None) -> None:
    global _stream, _start
    _stream = stream or sys.stderr
    _start = time.monotonic()


def disable() -> None:
    global _stream
    _stream = None


def enabled() -> bool:
    return _stream is not None


def say(text: str) -> None:
    """One progress line (a no-op unless enabled), prefixed with the seconds since the start."""
    stream = _stream
    if stream is None:
        return
    with _lock:
        try:
            stream.write(f"[{time.monotonic() - _start:5.0f}s] {text}\n")
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not fail the check
            pass
