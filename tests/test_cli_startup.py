"""What the CLI costs before it does anything, and the maintainer's scripts from a shell.

`list` and `--help` import only what they show: the table names each command's modules as
strings, imported on dispatch (`verify/cli/command.py`). Counted in a fresh interpreter by
`python -X importtime -m verify ...`, every module of ours it reports (once, in the order
imported). Before the table was lazy, `list` and `--help` imported 133 of the 147 modules
(now 34 and 7 of 148).

The scripts of `benchmarks/` (the tool's measurements of itself) keep the commands' contract:
`--help`, from a real shell, names the script and its flags and says nothing on stderr (run
without PYTHONPATH: a script finds the checkout it sits in); bad input, through the script's
`main()`, is one line and exit 2 with no traceback.

`audit` and `hang` start a launcher command before the tool imports torch.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("verify", "impls")
# What neither `list` nor `--help` shows: no checker, launcher, measurement, watchdog.
UNSHOWN = ("verify.checks", "verify.launching", "verify.perf", "verify.watching",
           "verify.sanitize", "verify.script_audit", "verify.runs")  # fmt: skip


def imported(*argv: str) -> list[str]:
    """The modules of ours `python -m verify ARGV` imports, from `-X importtime`."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "verify", *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = [
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    return [n for n in names if n.split(".")[0] in OURS]


@pytest.mark.parametrize("argv, most", [(["list"], 45), (["--help"], 10)])
def test_list_and_help_import_only_what_they_show(argv, most):
    """`list` needs the registry (every implementation, so all of impls/) and the
    workloads; `--help` the table's names and help lines."""
    names = imported(*argv)
    print(f"\npython -m verify {' '.join(argv)}: {len(names)} modules of ours")
    assert len(names) <= most, names
    assert not [n for n in names if n.startswith(UNSHOWN)], names
    if argv == ["--help"]:
        assert not [n for n in names if n.startswith("impls")], names


@pytest.mark.parametrize(
    "script, flag", [("audit_cost", "--script-audit"), ("tracer_cost", "--bucket-mb"),
                     ("sanitize_cost", "--matrix")],
)  # fmt: skip
def test_a_benchmark_script_keeps_the_commands_help_and_bad_input(script, flag, capsys):
    """`--help` from a real shell, without PYTHONPATH (the script finds its checkout, imports
    what its parser needs, and says nothing on stderr: bad input builds the same parser); bad
    input through the script's `main()` in this process, as `sys.exit(main())` runs it (one
    interpreter importing torch a script, not two)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = f"benchmarks/{script}.py"
    helped = subprocess.run(
        [sys.executable, path, "--help"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert helped.returncode == 0 and helped.stderr == "", helped.stderr[-2000:]
    assert helped.stdout.startswith(f"usage: python {path} [-h]"), helped.stdout
    assert flag in helped.stdout and "--repeats" in helped.stdout and "--json" in helped.stdout
    main = importlib.import_module(f"benchmarks.{script}").main
    assert main(["--repeats", "x"]) == 2
    bad = capsys.readouterr()
    assert bad.out == "" and "Traceback" not in bad.err
    assert bad.err == "verify: error: --repeats must be an integer, got 'x'\n", bad.err


# A fresh interpreter runs `audit` and `hang` on a launcher command as the CLI does, and notes
# at each process start whether this process had imported torch yet.
_STARTS = """
import subprocess, sys
from verify.cli import main
seen = []
class Noted(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        seen.append("torch" in sys.modules)
        super().__init__(*args, **kwargs)
subprocess.Popen = Noted
code = main(sys.argv[1:])
print("STARTS", seen, "EXIT", code)
"""


@pytest.mark.parametrize("command", ["audit", "hang"])
def test_a_launcher_command_starts_before_the_tool_imports_torch(command, tmp_path):
    """The launcher form's command starts before the tool's own import of torch, so the
    launcher's start (its agent importing torch) runs beside it (`verify/cli/head_start.py`;
    `benchmarks/launcher_cost.py` measures the second this saves). The command here is a
    Python process that joins no group: the run ends in "nothing joined", exit 2."""
    child = tmp_path / "child.py"
    child.write_text("print('no process group here')\n")
    argv = [command, "--out", str(tmp_path), "--", sys.executable, str(child)]
    proc = subprocess.run(
        [sys.executable, "-c", _STARTS, *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # the first process started is the command (a later one: `uname -p`, for the metadata)
    assert "STARTS [False" in proc.stdout and "EXIT 2" in proc.stdout, proc.stdout + proc.stderr
    assert "nothing joined a process group" in proc.stderr, proc.stderr[-2000:]


def test_the_installed_command_is_the_cli():
    """`ddp-verify` (pyproject.toml's script, installed beside this interpreter by the README's
    `pip install -e`) is `verify/__main__.py`'s `run`, as `python -m verify` is: its table, and
    bad input as one line and exit 2."""
    command = str(Path(sys.executable).with_name("ddp-verify"))
    with open(command) as script:  # pip's wrapper imports what the entry point names
        assert "from verify.__main__ import run" in script.read(), "stale: pip install -e ."
    listed = subprocess.run([command, "list"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "bucketed" in listed.stdout, listed.stderr
    bad = subprocess.run(
        [command, "consistency", "--steps", "x"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr == "verify: error: --steps must be an integer, got 'x'\n", bad.stderr
