"""One rank as the parent sees it: a process in a session of its own.

Every rank the tool starts, for a function (`spawn.py`) or a user's script (`script.py`), runs
`rank.main(<job fd>, <fd>)` in a process `RankProcess.start()` forks from a zygote
(`zygote.py`) or starts as a fresh interpreter (`python -c <boot> <job fd> <fd>`), the same
either way:

- its job from an anonymous file it inherits (`runner._job_file`): a pickle, so never from a
  file in a folder (another user could plant or swap one);

- a new session (`setsid` before exec): Ctrl-C in the terminal reaches the tool, never the
  ranks (which would print a KeyboardInterrupt traceback each); the parent ends them, and
  `killpg` ends whatever they started (DataLoader workers) with them;
- a pipe for the rank's reports (`rank.py` writes length-prefixed pickles: "up" once it has
  joined the process group, then its value or its traceback); EOF means the rank is gone;
- stdout and stderr to a file per rank, or (`stream=`) through the parent, which copies every
  line to the file and to its own console with a `[rank N]` prefix, as torchrun does;
- the environment of the parent, plus the thread budget and the launch's variables, set
  before the interpreter starts (OpenMP reads them once).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

import psutil

from verify.launching import tree

_LEN = struct.Struct("<I")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The child finds this package where the parent found it, whatever the child's sys.path.
# A function rank ends without the collector's last pass over torch's objects (~1 CPU-s:
# verify/__main__.py); a script's rank ends as `python train.py` does.
_BOOT = (
    f"import gc, sys; sys.path.insert(0, {_ROOT!r}); "
    "from verify.launching.rank import main; "
    "main(int(sys.argv[1]), int(sys.argv[2])) == 'fn' and gc.freeze()"
)


class RankProcess:
    """Start, read and end one rank (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        job_file,
        env: dict[str, str],
        *,
        log_path: str,
        stream: TextIO | None = None,
        err_path: str | None = None,
        zygote=None,
    ) -> None:
        self.rank = rank
        self.zygote = zygote  # fork from it (`zygote.py`) rather than start an interpreter
        self._pid: int | None = None
        self.job_file = job_file  # the job, pickled, in an anonymous file (`runner._job_file`)
        self.env = env
        self.log_path = log_path  # stdout and stderr (or stdout only, with err_path)
        self.err_path = err_path
        self.stream = stream
        self.proc: subprocess.Popen | None = None
        self.fd: int | None = None
        self._buffer = b""
        self.eof = False
        self._pumps: list[threading.Thread] = []

    def start(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Start the rank: forked from its zygote when there is one, else a fresh
        interpreter. `cancelled()` true while the zygote is awaited (Ctrl-C): not started."""
        if self.stream is not None:  # made before the rank can run: a rank that raises at once
            for path in {self.log_path, self.err_path} - {None}:  # appends its traceback here
                open(path, "wb").close()  # (`rank_script._print_traceback`), the pumps too
        read_end, write_end = os.pipe()
        if self.zygote is not None:
            if self._fork(read_end, write_end, cancelled):
                return
            if cancelled():
                os.close(read_end)
                os.close(write_end)
                return
        self.zygote = None  # refused or gone: a fresh interpreter
        try:
            out = err = None
            if self.stream is None:
                out = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child
                err = open(self.err_path, "wb") if self.err_path else subprocess.STDOUT  # noqa: SIM115
            job_fd = self.job_file.fileno()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(job_fd), str(write_end)],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out if out is not None else subprocess.PIPE,
                stderr=err if err is not None else subprocess.PIPE,
                pass_fds=(write_end, job_fd),
                start_new_session=True,
            )
        finally:
            os.close(write_end)  # only the child holds it now: EOF means the rank is gone
            for f in (out, err):
                if hasattr(f, "close"):
                    f.close()
        self._watch(read_end, self.proc.stdout, self.proc.stderr)

    def _fork(self, read_end: int, write_end: int, cancelled: Callable[[], bool]) -> bool:
        """Fork the rank from the zygote, its output where a fresh interpreter's would go;
        False if the zygote refused (the write end is still open then)."""
        pipes = [os.pipe(), os.pipe()] if self.stream is not None else []
        out, err = (pipes[0][1], pipes[1][1]) if pipes else (self.log_path, self.err_path)
        try:
            self._pid = self.zygote.spawn(
                self.job_file.fileno(), self.env, write_end, out=out, err=err, cancelled=cancelled
            )
        except BaseException:  # KeyboardInterrupt from the signal handler, in the wait
            for fd in (read_end, write_end, *(fd for pipe in pipes for fd in pipe)):
                os.close(fd)
            raise
        for _, pipe_write in pipes:
            os.close(pipe_write)  # only the rank holds them now: EOF when it is gone
        if self._pid is None:
            for pipe_read, _ in pipes:
                os.close(pipe_read)
            return False
        os.close(write_end)
        self._watch(read_end, *(os.fdopen(pipe_read, "rb") for pipe_read, _ in pipes))
        return True

    def _watch(self, read_end: int, stdout=None, stderr=None) -> None:
        """Read the started rank's reports from `read_end`; with a console, copy its output
        (the read ends of its stdout and stderr) to its files and, prefixed, the console."""
        os.set_blocking(read_end, False)
        self.fd = read_end
        if self.stream is not None:
            self._pumps = [
                _pump(stdout, self.log_path, self.stream, self.rank),
                _pump(stderr, self.err_path or self.log_path, self.stream, self.rank),
            ]

    @property
    def pid(self) -> int | None:
        if self._pid is not None:
            return self._pid
        return self.proc.pid if self.proc is not None else None

    @property
    def started(self) -> bool:
        return self.pid is not None

    def running(self) -> bool:
        return self.started and self.exitcode is None

    @property
    def exitcode(self) -> int | None:
        if self._pid is not None:
            return self.zygote.exitcode(self._pid)
        return self.proc.poll() if self.proc is not None else None

    def messages(self) -> list:
        """Every message the rank has sent since the last call (`outcome.Say`, `Up`,
        `RankReport`)."""
        if self.fd is None or self.eof:
            return []
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                break
            self._buffer += chunk
        out = []
        while len(self._buffer) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buffer)
            if len(self._buffer) < _LEN.size + size:
                break
            body = self._buffer[_LEN.size : _LEN.size + size]
            self._buffer = self._buffer[_LEN.size + size :]
            out.append(pickle.loads(body))
        return out

    def signal(self, sig: int) -> bool:
        """Send `sig` to the rank itself; False if it is gone."""
        if not self.running():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
            return True
        return False

    def wait(self, timeout: float) -> None:
        if self._pid is not None:
            self.zygote.wait(self._pid, timeout)
        elif self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)

    def _reap(self) -> None:
        # The rank leads its own session: end what it started (and itself, if still there).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self._pid is not None:
            self.zygote.wait(self._pid, 10.0)  # the zygote reaps it and tells us
        else:
            self.proc.wait()
        _group_gone(self.pid)
        for pump in self._pumps:
            pump.join(timeout=2)
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def end_all(ranks: list[RankProcess], grace_s: float = 0.5) -> None:
    """SIGTERM every rank at once (none outlives a peer long enough to report its death as
    its own failure), a short wait, then SIGKILL their sessions and reap them all."""
    started = [r for r in ranks if r.started]
    for r in started:
        r.signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for r in started:
        r.wait(max(0.0, end - time.monotonic()))
    for r in started:
        r._reap()


def _group_gone(pgid: int, within_s: float = 5.0) -> None:
    """Wait until process group `pgid` has no live member. SIGKILL is delivered at once, but a
    process takes a moment to exit (a torch interpreter unmaps gigabytes): without the wait,
    a worker the rank had started (mp.spawn, DataLoader) could still be running when the tool
    returns, and, holding the run's rendezvous variables, meet the next launch's store. (A
    process that made a session of its own is outside the group: neither killed nor waited
    for here.) Polled from every 10 ms up to every 100 ms: a group is gone in milliseconds."""
    end, pause = time.monotonic() + within_s, 0.01
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if not tree.group_members(pgid):  # zombies only: their parent reaps them
            return
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def send(fd: int | None, message: object) -> None:
    """In a rank: one report to the parent (a no-op without one, or once it is gone)."""
    if fd is None:
        return
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with contextlib.suppress(OSError):
        os.write(fd, _LEN.pack(len(body)) + body)


def _pump(pipe, path: str, console: TextIO, rank: int) -> threading.Thread:
    """Copy a rank's output to its file and, line by line with a rank prefix, to `console`
    (without the backend's INFO log: `BackendLog`). A file that cannot be written (a full
    disk, a removed run folder) is given up, never the echo: the rank's output is drained to
    its end, or a rank that prints would block on a full pipe."""

    def run() -> None:
        quiet = BackendLog()
        try:
            log = open(path, "ab")
        except OSError:
            log = None
        with log or contextlib.nullcontext():
            pending = b""
            for chunk in iter(lambda: pipe.read1(1 << 16), b""):
                log = _logged(log, chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                _echo(console, rank, quiet.drop(lines))
            if pending:
                _echo(console, rank, quiet.drop([pending]))

    thread = threading.Thread(target=run, name=f"rank{rank}-output", daemon=True)
    thread.start()
    return thread


def _logged(log, chunk: bytes):
    """`log` once `chunk` is written to it; None (given up) when it cannot be."""
    if log is None:
        return None
    try:
        log.write(chunk)
        log.flush()
        return log
    except OSError:
        with contextlib.suppress(OSError):
            log.close()  # (what it buffered is dropped with it)
        return None


_ECHO_LOCK = threading.Lock()


class BackendLog:
    """Which lines of one output stream are the backend's INFO log (TORCH_CPP_LOG_LEVEL=INFO,
    TORCH_DISTRIBUTED_DEBUG=INFO, which a hang report turns on): they go to the rank's file
    only, and the console shows what the script itself says.

    A record starts `I1126 03:58:26.987 file.cpp:132] ...`, with `[rank0]:` before it when
    c10d knows the rank. DDP's "DDP Initialized with:" record goes on over lines of its own
    (`broadcast_buffers: 1`, ..., `device_ids: `), ended by an empty line: after a record
    whose text ends in a colon, lowercase `key: value` lines and the empty line that ends them
    are the record's too. Anything else (a traceback, a print) ends it."""

    RECORD = re.compile(rb"^(\[rank\d+\]:)?\[?I\d{4} \d\d:\d\d:\d\d")
    FIELD = re.compile(rb"^[a-z_][a-z0-9_]*:( .*)?$")

    def __init__(self) -> None:
        self.fields = False  # inside a record's `key: value` lines

    def drop(self, lines: list[bytes]) -> list[bytes]:
        """`lines` without the backend's (the stream's state carries over between calls)."""
        kept = []
        for line in lines:
            text = line.rstrip(b"\r")
            if self.RECORD.match(text):
                self.fields = text.rstrip().endswith(b":")
            elif self.fields and self.FIELD.match(text):
                pass
            elif self.fields and not text.strip():
                self.fields = False
            else:
                self.fields = False
                kept.append(line)
        return kept


def _echo(console: TextIO, rank: int, lines: list[bytes]) -> None:
    if not lines:
        return
    text = "".join(f"[rank {rank}] {line.decode('utf-8', 'replace')}\n" for line in lines)
    with _ECHO_LOCK, contextlib.suppress(OSError, ValueError):
        console.write(text)
        console.flush()


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie nobody reaped yet is dead too (a process this user may
    not look at runs)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:
        return True
    except psutil.Error:  # gone (ZombieProcess, NoSuchProcess)
        return False
