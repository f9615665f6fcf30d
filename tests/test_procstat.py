"""The CPU evidence the hang watchdog rests on (verify/watching/procstat.py): a process that
computes reads as busy at every poll, one that waits as idle at most polls (a busy reading
only delays a hang verdict), on an idle machine here and with every core busy in
tests/test_load.py (which calls `meter_problems` under its hogs).

The computing process runs at `nice 19`, so on a crowded machine it gets about 1% of a core:
below any fixed CPU fraction, yet runnable all the time. That is the rank a watchdog must not
call hung (a CI run saw a rank evaluating for 6 s read as idle under load, and a false hang).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from verify.watching.procstat import CpuMeter

COMPUTE = "import os; os.nice(19); print(flush=True)\nwhile True: sum(range(1000))"
# Blocked the way a waiting rank is: a futex-style wait, with a background thread that wakes
# 20 times a second (4 times as often as the tool's helper thread in a real rank).
WAIT = (
    "import threading, time\n"
    "threading.Thread(target=lambda: [time.sleep(0.05) for _ in iter(int, 1)], daemon=True)"
    ".start()\n"
    "print(flush=True)\n"
    "threading.Event().wait()"
)
WATCH_S = 3.0
SAMPLE_S = 0.25  # the watchdog's period


def meter_problems() -> list[str]:
    """Watch a computing and a waiting process for WATCH_S; what the meters got wrong."""
    procs = {
        name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        for name, code in (("computing", COMPUTE), ("waiting", WAIT))
    }
    try:
        for p in procs.values():  # past the interpreter's start, which computes
            p.stdout.readline()
        # The watchdog judges ranks that have waited for the stall timeout, never one in its
        # first second (the starting rule covers that): let the exit from start-up settle.
        time.sleep(0.5)
        meters = {name: CpuMeter(p.pid) for name, p in procs.items()}
        said: dict[str, list[tuple[bool, str]]] = {name: [] for name in procs}
        end = time.monotonic() + WATCH_S
        while (now := time.monotonic()) < end:
            for name, meter in meters.items():
                meter.sample(now)
                if now - meter.samples[0][0] >= meter.window_s:
                    said[name].append((meter.busy(), _window(meter)))
            time.sleep(SAMPLE_S)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    problems = []
    if not said["computing"] or not all(busy for busy, _ in said["computing"]):
        problems.append(f"a computing process read as idle: {said['computing']}")
    # Read as busy now and then on a crowded machine, it only delays a hang verdict to a
    # later poll (procstat.CpuMeter); it must read as idle most of the time.
    if not said["waiting"] or 2 * sum(busy for busy, _ in said["waiting"]) > len(said["waiting"]):
        problems.append(f"a waiting process read as busy most of the time: {said['waiting']}")
    return problems


def _window(meter: CpuMeter) -> str:
    """What the meter saw: CPU seconds over wall seconds, and the runnable snapshots."""
    (t0, c0, _), (t1, c1, _) = meter.samples[0], meter.samples[-1]
    runnable = "".join("R" if r else "-" for _, _, r in meter.samples)
    return f"{c1 - c0:.2f}s/{t1 - t0:.2f}s {runnable}"


@pytest.mark.under_load
def test_meter_tells_computing_from_waiting():
    assert not meter_problems()
