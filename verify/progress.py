"""Progress on stderr while a command runs: what runs, n of m, and about how long is left.

Run functions call `say("matrix, world size 2: cell ", 12, 40, ": bucketed / no-sync /
equivalence")`, which says "matrix, world size 2: cell 12/40: bucketed / no-sync / equivalence";
the CLI decides whether anyone hears it (`enable`): on for text output, off under `--json`
unless `--progress` asks for it, so a JSON document on stdout is never mixed with anything. A
rank the tool started says it the same way: there `say` sends the line on the rank's report
pipe (`forward_to`), and it is printed here once, by the parent (never once per rank, never
replayed).

A message's count (`done` of `total`) is given as numbers, never read out of its text: the text
before it names the task ("matrix, world size 2: cell "), and from the pace since the task's
first count an estimate of what is left is added ("~40s left"), once there is a pace to go by.
A message without a count is a task of its own.

On a terminal every message rewrites one line in place, cleared before the report prints. On
anything else (a file, a pipe, CI's log) lines are kept, so they are thinned: `matrix --impl
all` says 564 cells. A line is written when it starts a task, restarts its count (a fresh
launch of the rest of the cells), or ends it (k = n), and otherwise only once `_gap` has passed
since the last line written: 5 s, growing to a tenth of the time the run has taken, so a run
of any length writes a few dozen lines. The newest line held back is written when progress
stops (`disable`), so a log cut short by Ctrl-C or SIGTERM says where the run was.
"""

from __future__ import annotations

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
_held: str | None = None  # (not a terminal) the newest line not written, if any
_written_at = 0.0  # (not a terminal) when the last line was written
# task -> (when its first count was seen, that count, the latest count)
_tasks: dict[str, tuple[float, int, int]] = {}
_forward = None  # in a rank the tool started: sends a line to the parent (`forward_to`)
MIN_GAP_S = 5.0  # the least time between two routine lines in a log
GAP_SHARE = 0.1  # ... or this share of the time the run has taken, if longer


def enable(stream: TextIO | None = None) -> None:
    global _stream, _start, _tty, _held, _written_at
    _stream = stream or sys.stderr
    _start = _written_at = time.monotonic()
    _tty = _isatty(_stream)
    _held = None
    _tasks.clear()


def disable() -> None:
    """Stop. On a terminal, clear the progress line so the report starts on a clean line;
    elsewhere, write the newest line held back, so a log ends with where the run was."""
    global _stream, _pending, _held
    with _lock:
        if _stream is not None and _pending:
            _write(_stream, "\r\033[K")
        if _stream is not None and _held is not None:
            _write(_stream, _held + "\n")
        _stream, _pending, _held = None, False, None


def forward_to(send) -> None:
    """In a rank the tool started: every `say` is `send(task, done, total, after)`, to the
    parent, which prints it (`launching/rank.py` sends it on the rank's report pipe)."""
    global _forward
    _forward = send


def enabled() -> bool:
    return _stream is not None


def say(task: str, done: int | None = None, total: int | None = None, after: str = "") -> None:
    """One progress line (a no-op unless enabled): `task`, then `done/total` when counted, then
    `after`, prefixed with the seconds since the start and followed by an estimate of the time
    left when counted; on a stream that is not a terminal it may be held back (module
    docstring)."""
    global _pending, _held, _written_at
    if _forward is not None:
        _forward(task, done, total, after)
        return
    stream = _stream
    if stream is None:
        return
    now = time.monotonic()
    count = None if done is None or total is None else (done, total)
    text = task + (f"{done}/{total}" if count else "") + after
    with _lock:
        news = _news(task, count)  # before _estimate records this count
        line = f"[{now - _start:5.0f}s] {text}{_estimate(task, count, now)}"
        if _tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            _write(stream, "\r\033[K" + line[:width])
            _pending = True
        elif news or now - _written_at >= _gap(now):
            _write(stream, line + "\n")
            _held, _written_at = None, now
        else:
            _held = line


def _gap(now: float) -> float:
    """The least time between two routine lines in a log (module docstring)."""
    return max(MIN_GAP_S, GAP_SHARE * (now - _start))


def _news(task: str, count: tuple[int, int] | None) -> bool:
    """Whether a message starts its task, restarts its count or ends it: always written."""
    if task not in _tasks:
        if count is None:
            _tasks[task] = (0.0, 0, 0)  # (no count: nothing to estimate)
        return True
    if count is None:
        return False
    done, total = count
    return done < _tasks[task][2] or done == total


def _estimate(task: str, count: tuple[int, int] | None, now: float) -> str:
    if count is None:
        return ""
    done, total = count
    first = _tasks.setdefault(task, (now, done, done))
    if done < first[2]:  # a count that restarted (a fresh launch): its pace starts again
        first = _tasks[task] = (now, done, done)
    _tasks[task] = (*first[:2], done)
    if done <= first[1] or done >= total:  # no pace yet, or nothing left
        return ""
    left = (now - first[0]) / (done - first[1]) * (total - done)
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
