"""A launcher command started (`audit -- torchrun --nproc-per-node 2 train.py`): the
environment its processes inherit, and its process. `command.py` watches it from then on.

This module imports no torch, nor anything that does: `audit` and `hang` start the command
before the tool imports torch (`verify/cli/head_start.py`), so the launcher's own start (its
agent importing torch, then its workers) runs beside the tool's import rather than after it:
on a laptop that is a second of the run's wall time.

What the command's processes inherit: `bootstrap/` first on PYTHONPATH (it arms, in every
Python process of the command, a hook that does nothing until the process calls
`init_process_group`; from then on the process is a rank of the tool's, `launched.py`), the
run's report folder, the set-ups its ranks start (`setups.py`, named by the front end: this
module knows none of them), and the run's secret (`roll_call.py`: environments are private to
their user). Beside what the caller's `env` adds (`--on-cpu`'s, `verify/plugins.py`), nothing
else is set: not torchrun's variables (Lightning starts its other ranks only when LOCAL_RANK is
unset), not the ranks' threads.

The command dies with the tool, whatever ends it: a guardian process started first
(`guardian.py`) ends every process of the run once the tool is gone, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from verify.launching import guardian, tree
from verify.launching.env import LAUNCHED_ENV, LAUNCHED_SECRET_ENV, LAUNCHED_SETUPS_ENV, STALL_ENV
from verify.launching.setups import SetUp, to_env

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CONSOLE_LOGGING = ("TORCH_CPP_LOG_LEVEL", "TORCH_DISTRIBUTED_DEBUG")


def is_command(argv: tuple[str, ...]) -> bool:
    """What follows `--` is a command (a launcher, `python x.py`), not a script to run under
    `--nproc`: its first word is not a .py file."""
    return bool(argv) and not argv[0].endswith(".py")


@dataclass
class Started:
    """A launcher command on its way: its words, its report folder, the environment it was
    given, its process and when it started (`time.monotonic()`). While it lasts, this process
    is a subreaper (`tree.subreaper`): workers whose launcher died come to it, not to init;
    and a guardian (`guardian.py`) ends every process of it if this process is killed.
    `command.run_command` watches it and ends it; `abandon` ends it unwatched."""

    argv: tuple[str, ...]
    report_dir: str
    env: dict[str, str]
    process: subprocess.Popen
    start: float
    reaping: contextlib.ExitStack

    @property
    def marker(self) -> bytes:
        """What every process of this launch carries in its environment (`tree.carries`)."""
        return f"{LAUNCHED_ENV}={self.env[LAUNCHED_ENV]}".encode()

    def abandon(self) -> None:
        """End the command and every process of it now, unwatched (the tool failed or was
        interrupted before it could watch)."""
        with self.reaping:
            tree.end_all([], self.process, 0.0, self.marker)


def start(
    argv: tuple[str, ...],
    *,
    report_dir: str,
    stall_timeout_s: float,
    env: dict[str, str] | None = None,
    console: TextIO | None = None,
    setups: Sequence[SetUp] = (),
) -> Started:
    """Start the command `argv` (module docstring). `env`: variables for its processes (the
    backend's logging at INFO is left out: here the output is the launcher's own, on the
    console, as the user would see it). `console`: where its output goes (sys.stdout as it
    is, sys.stderr when stdout is for --json, None: nowhere). `setups`: what each process
    that joins starts as a rank (`setups.py`), in order. Raises ValueError when the command
    is not found."""
    if shutil.which(argv[0]) is None:
        raise ValueError(
            f"command {argv[0]!r} not found: after -- give a launcher command on PATH "
            "(torchrun ..., accelerate launch ..., python train.py) or, with --nproc N, "
            "a script train.py"
        )
    env = {k: v for k, v in (env or {}).items() if k not in _CONSOLE_LOGGING}
    path = [BOOTSTRAP, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), _ROOT]
    child_env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
        LAUNCHED_ENV: os.path.abspath(report_dir),
        LAUNCHED_SETUPS_ENV: to_env(setups),
        LAUNCHED_SECRET_ENV: secrets.token_hex(32),
        STALL_ENV: repr(stall_timeout_s),
    }
    out = subprocess.DEVNULL if console is None else None if console is sys.stdout else 2
    marker = f"{LAUNCHED_ENV}={child_env[LAUNCHED_ENV]}".encode()
    reaping = contextlib.ExitStack()
    try:
        reaping.enter_context(tree.subreaper())
        # Before the command, so that no moment of it runs unguarded; closed first at the end,
        # once the tool has ended the launch (a sweep that finds nothing).
        guard = guardian.Guard(marker, dict(os.environ))
        reaping.callback(guard.close)
        begun = time.monotonic()
        process = subprocess.Popen(list(argv), env=child_env, stdout=out)
        guard.watch(process.pid)
    except BaseException:
        reaping.close()
        raise
    return Started(tuple(argv), report_dir, child_env, process, begun, reaping)
