"""`audit` and `hang` as the CLI runs them: a launcher command (`audit -- torchrun ...
train.py`) is started first, then the check is imported and watches it.

The check's modules import torch (a second or more); the launcher's agent imports torch too
before its workers start. Started in that order, the two imports overlap instead of following
each other: the launcher form then costs about what `--nproc N` does (goal: at most 1 s more,
`benchmarks/launcher_cost.py`). Everything up to the start imports no torch
(`checks/script_options.py`, `checks/script_start.py`, `launching/launcher.py`;
tests/test_cli_startup.py checks it). The check's contract is unchanged: without a head start
(`check_audit(options)` from Python) it starts the command itself.
"""

from __future__ import annotations

from verify.checks.script_start import start_command
from verify.cli.command import load
from verify.launching.launcher import Started, is_command


def audit(options):
    """`verify.checks.script_audit.check_audit`, its launcher command started first."""
    started = _start(options, "audit", audit_every=options.audit_every, record=options.recording)
    result = _check("verify.checks.script_audit:check_audit", options, started)
    if options.drill:  # below the first divergence, op by op (verify/checks/drill.py)
        return load("verify.checks.drill:drill_replicas")(result)
    return result


def hang(options):
    """`verify.checks.hang.check_hang`, its launcher command started first."""
    return _check("verify.checks.hang:check_hang", options, _start(options, "hang"))


def _start(options, command: str, **knobs) -> Started | None:
    if not is_command(options.script):  # a script under --nproc, --impl, --scenarios
        return None
    return start_command(options, command, **knobs)


def _check(reference: str, options, started: Started | None):
    try:
        return load(reference)(options, started)  # the import: torch, while the launcher starts
    except BaseException:  # an import error, Ctrl-C before the watch began: nothing left running
        if started is not None:
            started.abandon()  # after the watch ended it: nothing to do
        raise
