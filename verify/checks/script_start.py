"""Where a run of a user's script begins (`audit` and `hang`, `checks/script.py`): its report
folder, the environment its ranks get, where its output goes, and, for a launcher command
(`audit -- torchrun ... train.py`), the command started.

This module imports no torch, nor anything that does: the CLI starts a launcher command here
(`verify/cli/head_start.py`) before the tool imports torch, so that the launcher's own start
runs beside the tool's import (`launching/launcher.py`).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import TextIO

from verify import plugins, runs
from verify.launching import launcher
from verify.launching.env import DRILL_ENV, RECORD_ENV, backend_env
from verify.launching.launcher import Started, is_command


def run_folder(options, command: str, record: bool = False) -> str:
    """A new report folder for `command`'s run of `options.script`
    (`audit_train.py_2xcpu_<stamp>`, `audit_torchrun_train.py_Nxcpu_<stamp>`). `record`:
    `audit --record/--against`, whose folders are checked first (ValueError, exit 2)."""
    if record:
        from verify.recording import store  # numpy: only for a recording

        store.check_folders(options)
    device = "gpu" if options.backend == "nccl" else "cpu"
    ranks = "N" if is_command(options.script) else options.nproc
    name = f"{command}_{_named(options.script)}"
    folder = runs.new_run_dir(options.out, name, ranks, device)
    if is_command(options.script):  # started before its metadata is written (`script.py`)
        _writable(folder)
    return str(folder)


def _writable(folder) -> None:
    """A run folder a file can be written in, before a launcher command starts: else the
    folder removed and ValueError (one line, exit 2: the run could not be checked)."""
    probe = os.path.join(folder, ".writable")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)  # a block: a disk with none left refuses it
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as exc:
        raise unwritable(folder, exc) from None


def unwritable(folder, exc: OSError) -> ValueError:
    """The one line of a run folder that cannot be written (a full disk): the run cannot be
    checked (exit 2). The folder is removed first: nothing of the run is left."""
    shutil.rmtree(folder, ignore_errors=True)
    return ValueError(
        f"cannot write the run folder {folder}: {exc.strerror or exc} (free space there, or "
        "choose another folder with --out DIR)"
    )


def run_env(options, report_dir: str, record: bool) -> dict[str, str]:
    """What the run's processes get in their environment beside the launcher's own: the
    backend's logging (`env.backend_env`); for `--record`/`--against`, the recorder; for a
    drill-down's re-run, the step it captures."""
    env = {**backend_env(options.backend, report_dir), **({RECORD_ENV: "1"} if record else {})}
    if getattr(options, "drill_at", None):
        env[DRILL_ENV] = options.drill_at
        if options.drill_at.endswith(":eager"):  # a compiled run, drilled as eager ops
            env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def console_of(options) -> TextIO | None:
    """Where the script's output is echoed: stdout, stderr (under --json), or nowhere."""
    return {"stdout": sys.stdout, "stderr": sys.stderr}.get(options.console)


def start_command(
    options, command: str, *, audit_every: int | None = None, record: bool = False
) -> Started:
    """Start the launcher command `options.script` of `command`'s run in a new report folder
    (`launcher.start`); `command.run_command` watches it. Raises ValueError when the command
    is not found."""
    report_dir = run_folder(options, command, record)
    try:
        on_cpu = plugins.launcher_env(rehearsed_gpus() if options.on_cpu else 0)
        return launcher.start(
            options.script, report_dir=report_dir, stall_timeout_s=options.stall_timeout_s,
            env={**run_env(options, report_dir, record), **on_cpu}, console=console_of(options),
            setups=setups_of(options, audit_every),
        )  # fmt: skip
    except ValueError:  # the command is not found: nothing ran, no folder is left
        os.rmdir(report_dir)
        raise


def setups_of(options, audit_every: int | None):
    """What runs around the script in each rank (`plugins.script_setups`): the race sanitizer
    under `--sanitize`, the audit every `audit_every` steps (None: off), `--on-cpu`'s
    rehearsal."""
    return plugins.script_setups(
        sanitize=options.sanitize, audit_every=audit_every, on_cpu=options.on_cpu
    )


def rehearsed_gpus() -> int:
    """The GPUs of the node `--on-cpu` rehearses a launcher command on: what a process that is
    no rank yet (mp.spawn's parent, a Trainer(devices=2) before it starts its ranks) finds in
    `torch.cuda.device_count()`. The launcher decides the ranks; this only answers its
    question: CUDA_VISIBLE_DEVICES's count when set, as on a GPU node, else 2."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return len(visible) or 2


def _named(argv: tuple[str, ...]) -> str:
    """What names a run's folder: the script (`train.py`), or the command's first script
    (`torchrun_train.py`: `torchrun --nproc-per-node 2 train.py`)."""
    base = os.path.basename(argv[0])
    if not is_command(argv):
        return base
    script = next((os.path.basename(a) for a in argv[1:] if a.endswith(".py")), None)
    if script is None:
        return base
    return script if base.startswith("python") else f"{base}_{script}"
