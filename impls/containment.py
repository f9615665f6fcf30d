"""A user's module imported inside the tool's own process (`--impl file.py:Class`), kept from
acting as the tool: `contained(label)` around the import.

Importing a module runs it. What it may do there, and what the tool does about it:

- **exit** (`sys.exit(3)`, `raise SystemExit`): any BaseException but KeyboardInterrupt
  (Ctrl-C stays an interrupt) is turned into an `ImplError`, one line, exit 2, by the loader.
- **print**: stdout is for the report (with `--json`, one document), so while the module
  runs, what it writes to stdout goes to stderr: `sys.stdout` and file descriptor 1 alike
  (a C extension, `os.system`), and the user still sees it.
- **fork** (`os.fork()`, a fork-context `multiprocessing`): the child is ended at once, in
  `os.register_at_fork`'s child hook, before it runs another line, and the tool says so:
  a copy of the tool would otherwise go on running the rest of the command. Only forks
  from the importing thread: the tool's own process starts in other threads (the zygotes',
  a launch's ranks) are unaffected, and `subprocess` without `preexec_fn` never runs the
  hook. Ranks import the module again: there a fork is ended the same way, and whatever a
  rank leaves is ended with the rank's session by the launcher.
- **a thread**: a non-daemon thread would keep the tool alive after its verdict, since
  Python joins them at exit. The threads a contained import started are recorded
  (`threads_left()`), and the CLI's exit (`verify/__main__.py`) does not wait for those
  still running, with a note saying so.

Imports are contained one at a time (a lock): two at once in threads would restore each
other's stdout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

_lock = threading.Lock()
_importing: int | None = None  # the thread running a contained import, while it does
_forks = 0  # forks from that thread during the current import
_started: list[tuple[threading.Thread, str]] = []  # (thread, what started it)
FORKED_EXIT = 70  # the exit status of a child forked during a contained import


def _fork_in_child() -> None:
    if _importing is not None and threading.get_ident() == _importing:
        os._exit(FORKED_EXIT)  # no atexit, no flush of buffers copied from the parent


def _fork_in_parent() -> None:
    global _forks
    if _importing is not None and threading.get_ident() == _importing:
        _forks += 1


os.register_at_fork(after_in_child=_fork_in_child, after_in_parent=_fork_in_parent)


@contextlib.contextmanager
def contained(label: str):
    """Run the body (an import of the user's module `label`) contained as the module
    docstring says. Exceptions pass through: the loader turns them into one line."""
    global _importing, _forks
    with _lock:
        before = set(threading.enumerate())
        with _stdout_to_stderr():
            _importing, _forks = threading.get_ident(), 0
            try:
                yield
            finally:
                _importing, forks = None, _forks
        if forks:
            print(
                f"verify: note: importing {label} forked {forks} process(es): ended at once "
                "(a copy of the tool must not run)",
                file=sys.stderr,
            )
        _started.extend(
            (t, label) for t in threading.enumerate() if t not in before and not t.daemon
        )


def threads_left() -> list[tuple[threading.Thread, str]]:
    """The non-daemon threads contained imports started that still run, with the module that
    started each: the CLI's exit does not wait for them."""
    return [(t, label) for t, label in _started if t.is_alive()]


@contextlib.contextmanager
def _stdout_to_stderr():
    """sys.stdout and file descriptor 1 sent to stderr while the body runs."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2: sys.stdout alone
        saved = -1
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if saved >= 0:
            os.dup2(saved, 1)
            os.close(saved)
