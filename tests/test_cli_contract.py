"""The CLI contract, on every command: the surface is frozen, every flag has help,
bad input is one line and exit 2, each command offers only the names it can run, conflicting
flags are refused, a timeout is not a fault, and Ctrl-C ends everything at once.

The surface (commands, flags, defaults, choices, exit codes) is compared with
`tests/cli_surface.json`, so a refactor cannot change it silently. After a deliberate change,
regenerate it with `UPDATE_CLI_SURFACE=1 pytest tests/test_cli_contract.py` and review the
diff.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import audit_cost, on_cpu_cost, record_cost, sanitize_cost, tracer_cost
from tests.processes import alive, descendants
from verify.checks.verdict import EXIT_CODES
from verify.cli import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    build_parser,
    command_parser,
    main,
)
from verify.cli.command import Command
from verify.cli.commands import all_commands
from verify.options import flag_of

ROOT = Path(__file__).resolve().parent.parent
SURFACE = ROOT / "tests" / "cli_surface.json"
BENCHMARKS = {
    m.__name__.split(".")[-1]: m.COMMAND
    for m in (audit_cost, tracer_cost, sanitize_cost, record_cost, on_cpu_cost)
}


def surface() -> dict:
    """Every command's flags with their defaults and choices, the benchmark scripts' (the
    tool's measurements of itself, `benchmarks/`), and the exit codes."""
    codes = {**EXIT_CODES, "usage": EXIT_USAGE, "interrupted": EXIT_INTERRUPTED,
             "terminated": EXIT_TERMINATED}  # fmt: skip
    return {
        "commands": {c.name: _surface(c) for c in all_commands()},
        "benchmarks": {f"benchmarks/{name}.py": _surface(c) for name, c in BENCHMARKS.items()},
        "exit_codes": codes,
    }


def _surface(command: Command) -> dict:
    flags = {}
    options = command.options_class()
    if options is not None:
        for f in dataclasses.fields(options):
            if not f.metadata.get("cli", True):
                continue
            default = f.default
            if default is dataclasses.MISSING:
                factory = f.default_factory
                default = "<required>" if factory is dataclasses.MISSING else factory()
            offered = [f.metadata.get("negate") or flag_of(f)]
            if f.metadata.get("affirm"):  # the field's own flag is kept beside its negation
                offered.append(flag_of(f))
            for flag in offered:
                flags[flag] = {
                    "field": f.name,
                    "default": list(default) if isinstance(default, tuple) else default,
                    "choices": list(f.metadata["choices"]) if f.metadata.get("choices") else None,
                    "repeat": bool(f.metadata.get("repeat")),
                }
        flags["--json"] = flags["--progress"] = {"field": None, "default": False}
    return {"flags": flags, "script": command.script}


def test_the_cli_surface_is_frozen(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # torchrun changes one default
    monkeypatch.delenv("RANK", raising=False)
    now = json.loads(json.dumps(surface()))
    if os.environ.get("UPDATE_CLI_SURFACE"):
        SURFACE.write_text(json.dumps(now, indent=2, sort_keys=True) + "\n")
    frozen = json.loads(SURFACE.read_text())
    assert now == frozen, "the CLI surface changed: regenerate tests/cli_surface.json on purpose"


def test_every_flag_has_one_line_of_help_with_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    scripts = {name: command_parser(c, name) for name, c in BENCHMARKS.items()}
    for name, p in {**sub.choices, **scripts}.items():
        for action in p._actions:
            if action.dest in ("help",) or not action.option_strings:
                continue
            assert action.help and "\n" not in action.help, (name, action.option_strings)
            if action.nargs != 0 and action.dest not in ("impl", "impls", "script"):
                assert "default" in action.help or action.required or "(" in action.help, (
                    name, action.option_strings, action.help,
                )  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["consistency", "--impl", "hang:raise"], "unknown implementation 'hang:raise' for consistency"),
        (["equivalence", "--impl", "hang:skip-collective"], "for equivalence; choose one of"),
        (["matrix", "--impl", "hang:raise"], "for matrix; choose one of naive"),
        (["hang", "--impl", "faulty:no-divide"], "for hang; choose one of naive"),
        (["hang", "--scenarios", "--impl", "naive"], "--scenarios and --impl cannot be used together"),
        (["hang", "--nproc", "2", "--world-size", "3", "--", "x.py"], "--nproc and --world-size"),
        (["consistency", "--impl", "naive", "--threads-per-rank", "0"], "--threads-per-rank must be >= 1"),
        # a newcomer's slips: the class forgotten, a name or a choice misspelled
        (["consistency", "--impl", "docs/examples/student_ddp.py"],
         "name the class, e.g. docs/examples/student_ddp.py:StudentDDP (classes there: StudentDDP)"),
        (["consistency", "--impl", "bucketd"], "for consistency (did you mean bucketed?); choose"),
        (["consistency", "--impl", "naive", "--workload", "mlpp"],
         "verify: error: argument --workload: invalid choice: 'mlpp' (did you mean mlp? choose"),
        (["consistency", "--impl", "naive", "--steps", "x"], "error: --steps must be an integer"),
        # consistency: an implementation that cannot be found or is not one, a knob out of range
        (["consistency", "--impl", "no_such_module:Cls"], "module 'no_such_module' not found"),
        (["consistency", "--impl", "verify.training.workloads:Nope"], "has no class 'Nope' (classes there:"),
        (["consistency", "--impl", "tests/fixtures/user_classes.py:NotAWrapper"],
         "neither an nn.Module DDP wrapper nor a torch.optim.Optimizer"),
        (["consistency", "--impl", "missing/file.py:Cls"], "file missing/file.py does not exist"),
        (["consistency", "--impl", "bucketed", "--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["consistency", "--impl", "bucketed", "--bucket-mb", "0"], "--bucket-mb must be > 0, got 0"),
        (["consistency", "--impl", "bucketed", "--bucket-mb", "-3"], "--bucket-mb must be > 0, got -3"),
        (["consistency", "--impl", "bucketed", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["consistency"], "the following arguments are required: --impl"),
        # equivalence's own knobs
        (["equivalence", "--impl", "bucketed", "--accumulate", "0"], "--accumulate must be >= 1, got 0"),
        (["equivalence", "--impl", "bucketed", "--optimizer", "lion"], "invalid choice: 'lion'"),
        (["equivalence", "--impl", "bucketed", "--lr", "-1"], "--lr must be > 0, got -1"),
        # hang: the three ways to name what runs, and its timeout
        (["hang", "--nproc", "2"], "--nproc needs a script"),
        (["hang"], "give either --impl NAME, --scenarios, --nproc N -- script.py ARGS, or -- COMMAND"),
        (["hang", "--impl", "nope"], "unknown implementation 'nope'"),
        (["hang", "--nproc", "2", "--", "missing.py"], "script missing.py does not exist"),
        (["hang", "--impl", "bucketed", "--stall-timeout", "0"], "--stall-timeout must be > 0"),
        # audit: a script to run
        (
            ["audit", "--nproc", "2"],
            "audit needs a script or a command: audit --nproc N -- train.py ARGS, or audit -- "
            "torchrun ... train.py ARGS",
        ),
        (["audit", "--", "missing.py"], "script missing.py does not exist"),
        (["audit", "--audit-every", "0", "--", "tests/fixtures/audit_suite.py"],
         "--audit-every must be >= 1, got 0"),
        # the tool's measurements of itself: a maintainer's scripts now, named
        (["bench-tracer", "--repeats", "1"],
         "bench-tracer is not a command any more: it is a maintainer's script of the "
         "repository, python benchmarks/tracer_cost.py (same flags)"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_help_wraps_at_spaces_only(capsys):
    """A row key with hyphens stays whole in `--help` (argparse breaks at hyphens)."""
    with pytest.raises(SystemExit):
        main(["matrix", "--help"])
    out = capsys.readouterr().out
    assert "more-ranks-than-params" in out and "None" not in out


def test_names_offered_are_names_that_run(capsys):
    """`hang:*` only where they run (hang); `faulty:*` listed by `list`."""
    assert main(["consistency", "--impl", "nope"]) == 2
    err = capsys.readouterr().err
    assert "faulty:no-divide" in err and "hang:" not in err
    assert main(["hang", "--impl", "nope"]) == 2
    err = capsys.readouterr().err
    assert "hang:skip-collective" in err and "faulty:" not in err
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "faulty:no-divide" in out and "hang:deadlock" in out


@pytest.mark.parametrize("command", ["hang"])
def test_a_bad_out_is_one_line_and_exit_2(command, tmp_path, capsys):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    assert main([command, "--impl", "naive", "--out", str(afile)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not a folder" in err, err
    assert main([command, "--impl", "naive", "--out", "/proc/ddp-verify"]) == 2
    assert "cannot write there" in capsys.readouterr().err


def test_a_timeout_is_not_a_fault(run_cli):
    """Out of time before a verdict: exit 2 and "timeout" in the JSON, with what each rank was
    doing, never "FAULT"."""
    proc = run_cli(
        "consistency", "--impl", "bucketed", "--workload", "transformer", "--model-size", "2",
        "--steps", "100", "--timeout", "1", "--json",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "timeout" and doc["passed"] is False
    assert doc["headline"].startswith("TIMEOUT: timed out before a verdict"), doc["headline"]
    assert "rank 0 [timeout]" in doc["failure"] and "FAULT" not in proc.stdout
    # Where each rank was: the user's frame, or what the tool was doing in words (a built-in
    # inside backward), never the tool's own frames.
    for rank in (0, 1):
        where = rf"rank {rank} \[timeout\]: (\w+ \(\S+\.py:\d+\)|in .+, called by the tool|in the tool's)"
        assert re.search(where, doc["failure"]), doc["failure"]
    assert "verify/" not in doc["failure"], doc["failure"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupting_a_long_command_ends_it_at_once(sig, code):
    """Ctrl-C (or SIGTERM) in the middle of a matrix: one line, exit 130 (143), at once (the
    bar is 2 s; asserted with slack for a loaded machine, printed), no rank left running, no
    rank traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "verify", "matrix", "--impl", "naive", "--impl", "bucketed"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        ranks: set[int] = set()
        while time.monotonic() < deadline and len(ranks) < 3:  # ranks at work
            time.sleep(0.5)
            ranks = descendants(proc.pid)
        assert ranks, "no rank started"
        time.sleep(1.0)
        ranks |= descendants(proc.pid)
        proc.send_signal(sig)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == code, err
    # The bar is 2 s (0.8 s measured alone); under the suite's own load a few seconds more.
    print(f"\n{signal.Signals(sig).name}: every rank ended and the tool exited in {took:.2f}s")
    assert took < 6.0, took
    assert "verify: interrupted" in err and "Traceback" not in err, err
    time.sleep(0.2)
    assert not [p for p in ranks if alive(p)]
