"""A launcher command started (`audit -- torchrun --nproc-per-node 2 train.py`): the
environment its processes inherit, and its process. `command.py` watches it from then on.

This module imports no torch, nor anything that does: `audit` and `hang` start the command
before the tool imports torch (`verify/cli/head_start.py`), so the launcher's own start (its
agent importing torch, then its workers) runs beside the tool's import rather than after it:
on a laptop that is a second of the run's wall time.

What the command's processes inherit: `bootstrap/` first on PYTHONPATH (it arms, in every
Python process of the command, a hook that does nothing until the process calls
`init_process_group`; from then on the process is a rank of the tool's, `launched.py`), the
run's report folder and the audit's, the sanitizer's and `--on-cpu`'s settings, and the run's
secret (`roll_call.py`: environments are private to their user). Nothing else
is set: not torchrun's variables (Lightning starts its other ranks only when LOCAL_RANK is
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
from dataclasses import dataclass
from typing import TextIO

from verify.launching import guardian, tree
from verify.launching.env import (
    LAUNCHED_AUDIT_ENV,
    LAUNCHED_ENV,
    LAUNCHED_ON_CPU_ENV,
    LAUNCHED_SANITIZE_ENV,
    LAUNCHED_SECRET_ENV,
    STALL_ENV,
)

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
    sanitize: bool = False,
    audit_every: int | None = None,
    on_cpu: int = 0,
) -> Started:
    """Start the command `argv` (module docstring). `env`: variables for its processes (the
    backend's logging at INFO is left out: here the output is the launcher's own, on the
    console, as the user would see it). `console`: where its output goes (sys.stdout as it
    is, sys.stderr when stdout is for --json, None: nowhere). `audit_every`: the audit's
    period (None: off); `on_cpu` (0: off): every Python process of the command rehearses
    CUDA on the CPU from its import of torch, on a node of `on_cpu` GPUs (what
    `torch.cuda.device_count()` answers in a process that is no rank yet). Raises
    ValueError when the command is not found."""
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
        LAUNCHED_AUDIT_ENV: "" if audit_every is None else str(audit_every),
        LAUNCHED_SANITIZE_ENV: "1" if sanitize else "",
        LAUNCHED_ON_CPU_ENV: str(on_cpu) if on_cpu else "",
        LAUNCHED_SECRET_ENV: secrets.token_hex(32),
        STALL_ENV: repr(stall_timeout_s),
    }
    if on_cpu:  # the GPUs hidden from the launcher too, as in each rank (verify/oncpu/)
        child_env["CUDA_VISIBLE_DEVICES"] = ""
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
