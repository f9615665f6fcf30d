"""The guardian of a launcher command: a small process that outlives the tool only to end
what the tool started.

The tool ends every process of a launch itself (`tree.end_all`): at the verdict, at Ctrl-C or
SIGTERM, at the deadline. A SIGKILL of the tool (`kill -9`, the OOM killer, a scheduler's hard
stop) gives it no chance to: the launcher goes on under init, and a death signal on it would
not be enough, since torchrun's workers lead sessions of their own and would outlive torchrun
killed in turn. So `launcher.start` starts a guardian before the command (`Guard`):

- a fresh interpreter that imports the standard library, psutil and `tree.py` alone (no
  torch: tens of milliseconds, beside the launcher's own start), in a session of its own, so
  that a terminal's signals and a kill of the tool's process group do not reach it;
- its stdin is a pipe only the tool holds the other end of (the end is not inheritable: no
  process the tool starts keeps it open); the tool writes the launcher's pid there;
- when the pipe reaches its end (the tool closed it at the end of the launch, or the kernel
  did, whatever ended the tool) it ends, with SIGKILL, every process of the run: the launcher
  and what runs below it, and every process whose environment carries the run's marker
  (`tree.carries`: workers re-parented to init, the children of a script calling
  `mp.spawn`), round after round until none is left, then exits.

At the end of a launch the tool has already ended everything, so the guardian finds nothing;
the tool waits for it (`Guard.close`), and no guardian outlives a tool that ended normally.
A process of the run that started with a cleaned environment is found only while it is
still below the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from verify.launching import tree

SWEEP_S = 60.0  # how long the guardian goes on finding and killing the run's processes
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MAIN = "import sys; sys.path.insert(0, sys.argv[1]); from verify.launching.guardian import main; main(sys.argv[2])"  # noqa: E501


class Guard:
    """The tool's end of a guardian of the processes that carry `marker` (`NAME=value`): its
    process is started here, with the environment `env` (which must not carry the marker);
    `watch(pid)` names the launcher; `close()`, once the tool has ended the launch, ends the
    guard (the guardian sweeps once more, ends what the tool left, if anything, and exits)."""

    def __init__(self, marker: bytes, env: dict[str, str]) -> None:
        read, self._write = os.pipe()  # both ends not inheritable (PEP 446)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", _MAIN, _ROOT, marker.decode()],
                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    def watch(self, pid: int) -> None:
        """The launcher's pid (its start time with it: a pid used again is never killed); none
        for a launcher already gone, which nothing could tell from a process that got its pid."""
        if (started := tree.start_time(pid)) is None:
            return
        try:
            os.write(self._write, f"{pid} {started!r}\n".encode())
        except OSError:  # the guardian is gone (killed on its own): the tool still ends the run
            pass

    def close(self, wait_s: float = tree.GONE_S) -> None:
        if self._write < 0:
            return
        os.close(self._write)
        self._write = -1
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:  # still killing what was left: it ends on its own
            pass


def main(marker: str) -> None:
    """The guardian's process (module docstring): read launcher pids until the end of stdin,
    then end every process of the run."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    launchers: list[tuple[int, float]] = []
    for line in sys.stdin.buffer:  # until the end: the tool ended or closed the guard
        pid, started = line.split()
        launchers.append((int(pid), float(started)))
    sweep(marker.encode(), launchers)


def sweep(marker: bytes, launchers: list[tuple[int, float]], bound_s: float = SWEEP_S) -> None:
    """SIGKILL every process of the run (module docstring) until none is left, or `bound_s`."""
    me, end = os.getpid(), time.monotonic() + bound_s
    known: dict[int, float | None] = {}  # pid -> start time, of those found below a launcher
    while True:
        for pid, started in launchers:
            if tree.start_time(pid) == started:  # the tree first: once killed, it scatters
                known[pid] = started
                known.update((p, tree.start_time(p)) for p in tree.descendants(pid))
        carriers = [p for p in psutil.pids() if p != me and tree.carries(p, marker)]
        left = {p for p, t in known.items() if tree.start_time(p) == t} | set(carriers)
        left = {p for p in left if tree.live(p)}
        if not left or time.monotonic() > end:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
