"""Progress on stderr while a command runs: what runs, n of m, and about how long is left.

Run functions call `say("matrix, world size 2: cell 12/40: bucketed / no-sync / equivalence")`;
the CLI decides whether anyone hears it (`enable`): on for text output, off under `--json`
unless `--progress` asks for it, so a JSON document on stdout is never mixed with anything. A
rank says it with `verify.launching.rank.say`, which travels on the rank's report pipe and is
printed here once, by the parent (never once per rank, never replayed).

On a terminal it is one line, rewritten in place and cleared before the report prints; on
anything else (a file, a pipe, CI's log) one plain line each. The first `k/n` in a message is
its count: the text before it names the task, and from the pace since the task's first count
an estimate of what is left is added ("~40s left"), once there is a pace to go by.
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
from typing import TextIO

_stream: TextIO | None = None
_lock = threading.Lock()
_start = time.monotonic()
_tty = False
_pending = False  # a line is on the terminal, not ended by a newline
_tasks: dict[str, tuple[float, int]] = {}  # task -> (when its first count was seen, that count)
_COUNT = re.compile(r"(\d+)/(\d+)")


def enable(stream: TextIO | None = None) -> None:
    global _stream, _start, _tty
    _stream = stream or sys.stderr
    _start = time.monotonic()
    _tty = _isatty(_stream)
    _tasks.clear()


def disable() -> None:
    """Stop; on a terminal, clear the progress line so the report starts on a clean line."""
    global _stream, _pending
    with _lock:
        if _stream is not None and _pending:
            _write(_stream, "\r\033[K")
        _stream, _pending = None, False


def enabled() -> bool:
    return _stream is not None


def say(text: str) -> None:
    """One progress line (a no-op unless enabled), prefixed with the seconds since the start
    and followed by an estimate of the time left when `text` holds a count."""
    global _pending
    stream = _stream
    if stream is None:
        return
    now = time.monotonic()
    with _lock:
        line = f"[{now - _start:5.0f}s] {text}{_estimate(text, now)}"
        if _tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            _write(stream, "\r\033[K" + line[:width])
            _pending = True
        else:
            _write(stream, line + "\n")


def _estimate(text: str, now: float) -> str:
    m = _COUNT.search(text)
    if m is None:
        return ""
    done, total = int(m.group(1)), int(m.group(2))
    task = text[: m.start()]
    first = _tasks.setdefault(task, (now, done))
    if done <= first[1] or done > total:  # no pace yet (or a count that restarted)
        if done < first[1]:
            _tasks[task] = (now, done)
        return ""
    left = (now - first[0]) / (done - first[1]) * (total - done)
    if done == total:
        return ""
    return "  (under 1s left)" if left < 1 else f"  (~{left:.0f}s left)"


def _write(stream: TextIO, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # a closed or broken stderr must not fail the check
        pass


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
