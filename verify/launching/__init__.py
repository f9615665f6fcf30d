"""Launching: every multi-process run the tool makes goes through this package.

    launch(fn, world_size=N)        a function on N spawned ranks (or this torchrun rank)
    run_script(argv, nproc=N, ...)  a user's training script on N ranks, under the watchdog
    launcher.start(argv, ...)       a launcher command as given, then watched by
                                    command.run_command: each process that joins a group
                                    adopted as a rank (`launched.py`, `bootstrap/`)
    interrupt()                     end every supervised run now (Ctrl-C, SIGTERM)

One process type (`process.py`: a session of its own, forked from a zygote, `zygote.py`, or a
fresh interpreter), one set-up inside a rank (`rank.py`, its job `rank_job.py`; a script's
rank: `rank_script.py`), one supervisor (`supervisor.py`), one rank record (`outcome.py`), one
thread budget (`threads.py`); `torchrun.py` joins a job the tool did not start.
"""

import importlib

# Each name of the package, as "module:name" (the CLI table's form, which tests/test_imports.py
# reads as an import). They are imported on first use (PEP 562), not with the package:
# `launcher.py` (the launcher form's start) and `env.py` import no torch, and importing them
# must not pull in the rest of the launcher, which does.
_NAMES = (
    "verify.launching.env:DEFAULT_STALL_TIMEOUT_S",
    "verify.launching.env:STALL_ENV",
    "verify.launching.supervisor:Interrupted",
    "verify.launching.outcome:LaunchResult",
    "verify.launching.outcome:Raised",
    "verify.launching.outcome:RankContext",
    "verify.launching.outcome:RankOutcome",
    "verify.launching.threads:ThreadBudget",
    "verify.launching.supervisor:check_interrupted",
    "verify.launching.supervisor:interrupt",
    "verify.launching.supervisor:reset_interrupt",
    "verify.launching.spawn:launch",
    "verify.launching.script:run_script",
    "verify.launching.threads:thread_budget",
)
_HOMES = dict(reversed(ref.split(":")) for ref in _NAMES)
__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next look finds it here
    return value
