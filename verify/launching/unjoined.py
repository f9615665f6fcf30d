"""What a process of a launcher command leaves for the tool when it ends without ever joining
a process group (`audit -- torchrun ... train.py` where `train.py` does not exist, or raises
before `init_process_group`), so that the tool's one line says what the ranks died of, where,
and what to do, as the `--nproc` form's does (`checks/script.py`).

The bootstrap (`bootstrap/sitecustomize.py`) calls `no_script` at start-up, when the process
is to run a script file that is not there (Python then says "can't open file" and exits 2),
and `failed` from its `sys.excepthook`, for an exception that reaches the top of a process
that never joined. Each leaves `unjoined.<pid>.json` in the run folder:

- {"missing": path}: the script the process was to run does not exist;
- {"error": "AttributeError: ...", "where": "train.py:21", "needs_cuda": {...} or None}:
  what it raised and where in the user's code; `needs_cuda` where it is torch saying CUDA or
  NCCL is missing (`needs_cuda.classify`), a usage error: its traceback then goes to
  `unjoined.<pid>.stderr`, not the console, as a `--nproc` rank's does.

A launcher's own failure that only echoes its workers' (torchrun's ChildFailedError box,
mp.spawn's ProcessRaisedException) leaves nothing, and its traceback goes to its file too
once a worker left a usage error: the console keeps the tool's line. So does every process's
KeyboardInterrupt (a Ctrl-C, which torchrun passes on to its workers), joined or not
(`interrupted`): the tool says "verify: interrupted". From a Ctrl-C on, whatever else a
process prints on stderr goes to that file too (the bootstrap's SIGINT handler): an mp.spawn
worker, interrupted again by its parent's death signal while its exit handlers run.

mp.spawn's worker wrapper catches a worker's exception and exits 1 inside its `except`, so
no excepthook sees it: the bootstrap's `sys.exit` notes what was being handled, as `failed`
does an uncaught one.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import traceback

from verify.launching.env import LAUNCHED_ENV, LAUNCHED_ON_CPU_ENV

# A launcher's exceptions that say one of its workers failed: echoes, not causes.
ECHOES = ("ChildFailedError", "ProcessRaisedException", "ProcessExitedException")
SIGNALS = ("SignalException",)  # torch.distributed.elastic's, raised at SIGINT and SIGTERM
_NAME = "unjoined.{pid}.{ext}"


def no_script(folder: str, argv: list[str]) -> None:
    """At start-up: note a script file that this process is to run and that is not there."""
    path = argv[0] if argv else ""
    if path.endswith(".py") and not os.path.exists(path):
        _leave(folder, {"missing": path})


def failed(exc: BaseException) -> bool:
    """From the excepthook of a process that never joined: note what it raised. Returns
    whether its traceback was written to its file instead of the console (module
    docstring)."""
    folder = os.environ.get(LAUNCHED_ENV)
    if not folder:
        return False
    echo = type(exc).__name__ in ECHOES
    needs = None if echo else _needs_cuda(exc)
    if not echo:
        from verify.launching.needs_cuda import shown, user_frame

        frame = user_frame(exc)
        where = f"{shown(frame.filename)}:{frame.lineno}" if frame is not None else None
        first = (str(exc).splitlines() or [""])[0]
        _leave(folder, {"error": f"{type(exc).__name__}: {first}".rstrip(": "), "where": where,
                        "needs_cuda": None if needs is None else vars(needs)})  # fmt: skip
    if needs is None and not (echo and usage_noted(folder)):
        return False
    return _keep(os.path.join(folder, _NAME.format(pid=os.getpid(), ext="stderr")), exc)


def _keep(path: str, exc: BaseException) -> bool:
    """Add `exc`'s traceback to `path` (True), or leave it to the console (False)."""
    with contextlib.suppress(OSError):
        with open(path, "a") as f:
            f.write("".join(traceback.format_exception(exc)))
        return True
    return False


def interrupted(exc: BaseException) -> bool:
    """From the excepthook of any process of the command, joined or not: a Ctrl-C (or the
    launcher's word for a signal, torchrun's SignalException) is the tool's to say ("verify:
    interrupted"), so its traceback goes to `interrupted.<pid>.stderr`. Returns whether it
    did."""
    folder = os.environ.get(LAUNCHED_ENV)
    if not folder or not (isinstance(exc, KeyboardInterrupt) or type(exc).__name__ in SIGNALS):
        return False
    return _keep(os.path.join(folder, f"interrupted.{os.getpid()}.stderr"), exc)


def read(folder: str) -> list[dict]:
    """Every note the command's processes left (module docstring), in process-id order."""
    notes = []
    for path in sorted(
        glob.glob(os.path.join(glob.escape(folder), _NAME.format(pid="*", ext="json")))
    ):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                notes.append(json.load(f))
    return notes


def usage_noted(folder: str) -> bool:
    """Whether a process of the command left a usage error: a missing script, or CUDA."""
    return any(n.get("missing") or n.get("needs_cuda") for n in read(folder))


def _needs_cuda(exc: BaseException):
    """torch saying CUDA is missing (`needs_cuda.classify`), where torch is loaded and no
    rehearsal runs (under --on-cpu the rehearsal reads its own failures)."""
    if "torch" not in sys.modules or os.environ.get(LAUNCHED_ON_CPU_ENV):
        return None
    from verify.launching.needs_cuda import classify

    with contextlib.suppress(Exception):
        return classify(exc)
    return None


def _leave(folder: str, note: dict) -> None:
    with contextlib.suppress(OSError):
        path = os.path.join(folder, _NAME.format(pid=os.getpid(), ext="json"))
        with open(f"{path}.tmp", "w") as f:
            json.dump(note, f)
        os.replace(f"{path}.tmp", path)
