"""What each test file costs in CPU-seconds: the maintainer's measure of the suite's cost.

    python -m tests.cpu_seconds                        # every tests/test_*.py, one at a time,
                                                       # as in the whole suite (no idle twins)
    python -m tests.cpu_seconds tests/test_hang.py     # some files (or node ids), as alone
    python -m tests.cpu_seconds --json out.json ...    # and the numbers as JSON

(from the repository's root, in its environment). Each file runs as `pytest -n 0 -q FILE`;
its cost is the user + system time of pytest and of every process below it. CPU-seconds, not
wall time: the suite is CPU-bound (under `pytest -n auto` every core is busy for the whole
run, so its wall time is about the total over the cores), and CPU time barely moves with
what else the machine runs, where wall time moves with every other job on it.

Why this process is a child subreaper (PR_SET_CHILD_SUBREAPER): a `getrusage` around pytest
counts only what pytest itself reaped. A zygote dies with pytest (PR_SET_PDEATHSIG) and is
reaped by init, its ranks' CPU with it; so are the grandchildren a server or a torchrun
agent leaves. Here they are re-parented to this process and reaped here at once (a zombie
must not look alive to a test that asserts nothing is left), so their CPU is counted too.

A file run alone pays what a worker of `pytest -n auto` pays once: pytest's start and torch's
import (~2 CPU-s), a zygote's preload (~3.5 CPU-s) per rank index per set of import-time
variables.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.processes import AS_IN_THE_SUITE

PR_SET_CHILD_SUBREAPER = 36
LINGER_S = 30.0  # how long orphans left by a file may take to end after pytest exits


def cpu_seconds(target: str, env: dict | None = None) -> tuple[float, float, int, str]:
    """`pytest -n 0 -q TARGET` and everything below it: (CPU-s, wall s, exit code, last line).
    Needs this process to be a subreaper (`main`)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    argv = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", target]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        # Reap whatever ends below us as it ends, pytest included (so not through Popen).
        code, ended = None, None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break  # nothing left below us
            if pid == proc.pid:
                code, ended = os.waitstatus_to_exitcode(status), time.monotonic()
            elif pid == 0:
                if ended is not None and time.monotonic() - ended > LINGER_S:
                    break
                time.sleep(0.05)
        proc.returncode = code  # (reaped here: Popen must not wait for it again)
        log.seek(0)
        out = log.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (out.strip().splitlines() or [""])[-1]
    return cpu, ended - start, code, last


def main(argv: list[str]) -> int:
    """The command line of the module docstring: 1 when a file failed, else 0."""
    path = None
    if "--json" in argv:
        i = argv.index("--json")
        path, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("tests.cpu_seconds: error: needs Linux (PR_SET_CHILD_SUBREAPER)", file=sys.stderr)
        return 2
    targets = argv or sorted(str(p) for p in Path("tests").glob("test_*.py"))
    # Every file: what each costs in the whole suite, whose hog window runs the `under_load`
    # tests' verdicts (tests/conftest.py): skipped here too. Some files: as they run alone.
    env = None if argv else {**os.environ, AS_IN_THE_SUITE: "1"}
    results, total = {}, 0.0
    for target in targets:
        cpu, wall, code, last = cpu_seconds(target, env)
        total += cpu
        results[target] = {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "exit": code}
        print(f"{target:50s} {cpu:7.1f} CPU-s {wall:7.1f} s  {last}", flush=True)
    print(f"{'total':50s} {total:7.1f} CPU-s ({len(targets)} files)")
    if path:
        Path(path).write_text(json.dumps(results, indent=1) + "\n")
    return 1 if any(r["exit"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
