"""Launching: every multi-process run the tool makes goes through this package.

    launch(fn, world_size=N)        a function on N spawned ranks (or this torchrun rank)
    run_script(argv, nproc=N, ...)  a user's training script on N ranks, under the watchdog
    command.run_command(argv, ...)  a launcher command as given, each process that joins a
                                    group adopted as a rank (`launched.py`, `bootstrap/`)
    interrupt()                     end every supervised run now (Ctrl-C, SIGTERM)

One process type (`process.py`: a fresh interpreter in a session of its own), one set-up inside
a rank (`rank.py`, its job `rank_job.py`; a script's rank: `rank_script.py`), one supervisor
(`supervisor.py`), one rank record (`outcome.py`), one thread budget (`threads.py`);
`torchrun.py` joins a job the tool did not start.
"""

from verify.launching.env import DEFAULT_STALL_TIMEOUT_S, STALL_ENV
from verify.launching.outcome import LaunchResult, RankContext, RankOutcome
from verify.launching.script import run_script
from verify.launching.spawn import launch
from verify.launching.supervisor import Interrupted, check_interrupted, interrupt, reset_interrupt
from verify.launching.threads import ThreadBudget, thread_budget

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "STALL_ENV",
    "Interrupted",
    "LaunchResult",
    "RankContext",
    "RankOutcome",
    "ThreadBudget",
    "check_interrupted",
    "interrupt",
    "reset_interrupt",
    "launch",
    "run_script",
    "thread_budget",
]
