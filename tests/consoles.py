"""`python -m verify ARGS` as `main()` in a thread of the test's process, its console its own.

Several commands run at once in threads (each launch has its own rendezvous) print to one
sys.stdout and sys.stderr. While `run_main` runs, both route what is written by thread: a
thread running a command, and every thread it starts (the ranks' output pumps, which echo a
script's lines to the console, a command's own pools), write to that command's buffers;
any other thread to the real streams. So each command's console is what a user would see
from it, without an interpreter started and importing torch for it (~2 s of CPU a command).

What a real interpreter alone shows (a traceback the interpreter prints on its way out, a
signal's effect, a shell's view) still needs a real process: tests of those start one.

One limit: the progress lines (`verify/progress.py`) are one switch for the process, so with
commands in several threads one command's progress may show in, or be silenced by, another's
stderr. Assert on stdout, the exit code and the lines a command prints itself, not on the
progress lines of commands run side by side.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from dataclasses import dataclass

from verify.cli import main

__all__ = ["Ran", "run_main"]


@dataclass
class Ran:
    """What a command returned and printed (as `subprocess.CompletedProcess` has it)."""

    returncode: int
    stdout: str
    stderr: str


class _Console:
    """One command's stdout and stderr."""

    def __init__(self) -> None:
        self.stdout, self.stderr = io.StringIO(), io.StringIO()


_owners: dict[int, _Console] = {}  # thread ident -> the console it writes to
_lock = threading.Lock()
_users = 0
_saved: tuple = ()


class _Routed(io.TextIOBase):
    """sys.stdout or sys.stderr while commands run in threads (module docstring)."""

    def __init__(self, real, name: str) -> None:
        self.real, self.name = real, name

    def _target(self):
        console = _owners.get(threading.get_ident())
        return self.real if console is None else getattr(console, self.name)

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False  # a buffer, as a pipe to a test is


def _start(thread: threading.Thread, _original=threading.Thread.start) -> None:
    """Thread.start while commands run: a thread started by a command's thread is its too."""
    console = _owners.get(threading.get_ident())
    if console is not None:
        run = thread.run

        def owned_run() -> None:
            me = threading.get_ident()
            _owners[me] = console
            try:
                run()
            finally:
                _owners.pop(me, None)

        thread.run = owned_run
    _original(thread)


@contextlib.contextmanager
def _routing():
    """Route sys.stdout, sys.stderr and thread starts while any command runs here."""
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = (sys.stdout, sys.stderr, threading.Thread.start)
            sys.stdout, sys.stderr = _Routed(sys.stdout, "stdout"), _Routed(sys.stderr, "stderr")
            threading.Thread.start = _start
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                sys.stdout, sys.stderr, threading.Thread.start = _saved


def run_main(*args: str) -> Ran:
    """`python -m verify ARGS` as `main()` in this thread, with a console of its own (module
    docstring); safe to call from several threads at once."""
    console, me = _Console(), threading.get_ident()
    with _routing():
        _owners[me] = console
        try:
            code = main(list(args))
        finally:
            _owners.pop(me, None)
    return Ran(code, console.stdout.getvalue(), console.stderr.getvalue())
