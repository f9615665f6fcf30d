"""`python -m verify ARGS` and the `ddp-verify` command: the CLI (`verify.cli.main`), then an
exit that skips the collector's last pass.

Why `gc.freeze()` before the exit: when the interpreter ends it tears its modules down and runs
a full collection over every object torch created at import, about 1 CPU-second a command
(0.8 s of the ~3.5 s a bare `import torch, torch._dynamo` costs; under load, several seconds of
wall time after "verify: interrupted" was printed). Threads are still joined, atexit functions
run (temporary folders, logging's flush), objects freed by their reference counts. What frozen
objects alone keep alive is left to the operating system: a file whose last reference is in a
module's state would not be flushed, and the tool keeps none there. Only here, where the
process ends: a user's script ends as Python ends it (`launching/zygote_serve.py`), and `main()`
called in a long-lived process (the tests, a notebook) freezes nothing.

Threads an `--impl` module started when it was imported are not waited for (a note says so):
the exit is the tool's, not the user's code's.
"""

import atexit
import contextlib
import gc
import os
import sys

from verify.cli import main


def run() -> None:
    code = main()
    gc.freeze()
    _exit_without_users_threads(code)
    sys.exit(code)


def _exit_without_users_threads(code: int) -> None:
    """Exit now, not waiting for the threads an `--impl` module started when the tool imported
    it (`impls/containment.py`): Python would join them, and a thread that never ends would
    hold the tool after its verdict. A note names each; atexit functions still run."""
    containment = sys.modules.get("impls.containment")  # imported only if a module was
    left = containment.threads_left() if containment else []
    if not left:
        return
    for thread, label in left:
        print(
            f"verify: note: not waiting for thread {thread.name!r}, which importing {label} "
            "started and which still runs",
            file=sys.stderr,
        )
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
