"""The process-tree reads the launchers and the watchdog rest on (verify/launching/tree.py,
guardian.py's sweep, procstat.py's samples), on this test's own children: a process and the
child it starts, a zombie, a session of its own, a busy thread beside a waiting main thread.
In-process and quick: each child is a bare interpreter that prints once it is ready."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verify.launching import guardian, process, tree
from verify.launching.zygote_serve import _one_thread
from verify.watching.procstat import sample_tree

ROOT = str(Path(__file__).resolve().parents[1])
WAIT = "import threading; print(flush=True); threading.Event().wait()"
# A parent that starts WAIT as its child and prints the child's pid once the child is ready.
PARENT = (
    "import subprocess, sys, threading\n"
    f"c = subprocess.Popen([sys.executable, '-c', {WAIT!r}], stdout=subprocess.PIPE)\n"
    "c.stdout.readline(); print(c.pid, flush=True); threading.Event().wait()"
)
# The main thread waits, another computes: only the thread's own state shows the work.
BUSY_THREAD = (
    "import threading\n"
    "threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(int, 1)]).start()\n"
    "print(flush=True); threading.Event().wait()"
)


def _start(code: str, **kwargs) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, **kwargs)
    return p, p.stdout.readline().decode().strip()


def _end(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.kill()
        p.wait()


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while tree.live(pid) and time.monotonic() < end:
        time.sleep(0.02)
    return not tree.live(pid)


def test_a_child_and_its_child_are_found_live_and_named_by_their_start():
    parent, said = _start(PARENT)
    child = int(said)
    try:
        assert {parent.pid, child} <= set(tree.descendants(os.getpid()))
        assert tree.descendants(parent.pid) == [child]
        assert tree.live(child) and process.alive(child)
        started = tree.start_time(child)
        assert started is not None and started == tree.start_time(child)
        assert tree.start_time(parent.pid) <= started  # seconds after boot, to its ticks
    finally:
        os.kill(child, 9)
        _end(parent)
    assert _gone(child)  # re-parented (to init, or a subreaper), which reaps it
    assert tree.start_time(parent.pid) is None and tree.descendants(parent.pid) == []


def test_an_unreaped_child_is_no_longer_live_and_computes_nothing():
    p, _ = _start(WAIT)
    try:
        p.send_signal(9)
        end = time.monotonic() + 10
        while tree.live(p.pid) and time.monotonic() < end:
            time.sleep(0.02)
        assert not tree.live(p.pid) and not process.alive(p.pid)  # a zombie until reaped
        assert tree.start_time(p.pid) is not None  # still names it
        assert p.pid not in tree.descendants(os.getpid())
        assert sample_tree(p.pid) == (0.0, False)
    finally:
        p.wait()
    assert sample_tree(p.pid) is None and not process.alive(p.pid)


def test_group_members_and_the_marker_in_the_environment():
    marker = f"DDP_VERIFY_TEST_MARK={os.getpid()}"
    env = {**os.environ, "DDP_VERIFY_TEST_MARK": str(os.getpid())}
    leader, said = _start(PARENT, start_new_session=True, env=env)
    child = int(said)
    try:
        assert sorted(tree.group_members(leader.pid)) == sorted([leader.pid, child])
        assert tree.carries(child, marker.encode()) and tree.carries(leader.pid, marker.encode())
        assert not tree.carries(child, marker.encode() + b"0")
        assert not tree.carries(os.getpid(), marker.encode())
    finally:
        os.kill(child, 9)
        _end(leader)
    assert _gone(child) and tree.group_members(leader.pid) == []
    assert not tree.carries(child, marker.encode())


def test_the_sweep_ends_a_launcher_and_its_child_but_not_a_pid_given_again():
    parent, said = _start(PARENT)
    child = int(said)
    try:
        other_start = tree.start_time(parent.pid) + 1.0  # another process once had this pid
        guardian.sweep(b"DDP_VERIFY_TEST_MARK=none", [(parent.pid, other_start)], bound_s=2.0)
        assert tree.live(parent.pid) and tree.live(child)
        guardian.sweep(b"DDP_VERIFY_TEST_MARK=none", [(parent.pid, tree.start_time(parent.pid))])
        parent.wait(10)
        assert _gone(child)
    finally:
        _end(parent)
        if tree.live(child):
            os.kill(child, 9)


def test_a_guard_told_of_a_launcher_already_gone_still_sweeps():
    """A launcher reaped before `watch` has no start time: nothing is sent for it, and the
    guardian still reads to the end and exits (it used to be sent "None", which it failed on,
    sweeping nothing)."""
    p, _ = _start(WAIT)
    _end(p)
    guard = guardian.Guard(b"DDP_VERIFY_TEST_MARK=none", dict(os.environ))
    guard.watch(p.pid)
    guard.close()
    assert guard.process.returncode == 0


def test_a_thread_that_computes_beside_a_waiting_main_thread_is_runnable():
    p, _ = _start(BUSY_THREAD)
    try:
        time.sleep(0.3)
        samples = [sample_tree(p.pid) for _ in range(5) if not time.sleep(0.05)]
        assert sum(runnable for _, runnable in samples) >= 3
        assert samples[-1][0] > samples[0][0]
    finally:
        _end(p)


def test_a_computing_child_counts_for_its_waiting_parent():
    parent, _ = _start(
        "import subprocess, sys, threading\n"
        f"subprocess.Popen([sys.executable, '-c', {BUSY_THREAD!r}])\n"
        "print(flush=True); threading.Event().wait()"
    )
    try:
        time.sleep(1.5)  # the child started, and the walk of the processes saw it
        (c0, _), _, (c1, runnable) = (
            sample_tree(parent.pid),
            time.sleep(0.5),
            sample_tree(parent.pid),
        )
        assert c1 - c0 > 0.1 and runnable
    finally:
        for pid in tree.descendants(parent.pid):
            os.kill(pid, 9)
        _end(parent)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's state: Linux")
def test_a_process_measuring_itself_leaves_out_the_measuring_thread():
    """This thread computes between the samples and reads its own tree: neither its CPU nor
    its state shows (others of this process idle)."""
    c0, _ = sample_tree(os.getpid())
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        sum(range(1000))
    c1, runnable = sample_tree(os.getpid())
    assert c1 - c0 < 0.1 and not runnable


def test_one_thread_is_what_the_zygote_forks_from():
    alone = subprocess.run(
        [sys.executable, "-c", "from verify.launching.zygote_serve import _one_thread as o; "
         "print(o())"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT},
    )  # fmt: skip
    assert alone.stdout.strip() == str(sys.platform.startswith("linux"))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not _one_thread()
    finally:
        stop.set()
        other.join()
