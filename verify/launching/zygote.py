"""The zygote: one interpreter per tool process that has imported torch once, and forks ranks.

Why: a fresh interpreter spends ~2 s of CPU importing torch before a rank does anything; the
checks and the test suite start hundreds of ranks. A rank forked from a process that already
imported torch starts in milliseconds.

Why it is safe: `fork` copies one thread, so it is safe only in a process that has one thread
and no state a thread or a device would hold. The zygote imports torch and this tool's modules
and nothing else happens in it: no tensor operation (OpenMP and MKL start their threads at the
first parallel region, in the rank), no CUDA, no process group; numpy's OpenBLAS, which starts
a thread at import, is held to one thread (OPENBLAS_NUM_THREADS=1). Before every fork it
checks that it still has exactly one thread, and refuses (the launcher then starts a fresh
interpreter) otherwise.

When it is used (`spawn.launch` decides): function ranks on gloo. Variables torch reads when
it is imported (TORCH_CPP_LOG_LEVEL, TORCH_DISTRIBUTED_DEBUG: the hang report's debug logs)
cannot be set after the fork, so each set of them gets a zygote of its own, started with them
(`Zygote.get(import_env)`). A user's script always gets a fresh interpreter, exactly as
`python train.py` would.

Each forked rank leads a session of its own (Ctrl-C and `killpg` as for any rank), takes the
launch's environment and working directory, and dies with the zygote, which dies with the
tool (PR_SET_PDEATHSIG). The zygote reaps its children and tells the tool their exit status.

A request the tool stopped waiting for must never become a rank: the tool has started that
rank as a fresh interpreter meanwhile, on the same report pipe, and a second copy would join
the rendezvous in its place. On a crowded machine a zygote still importing torch can take
longer than the tool waits. So each request carries a deadline (`CLOCK_MONOTONIC`, the same
clock in every process), earlier than the tool's own by a margin, past which the zygote
refuses it; and a rank whose "started" arrives after the tool gave up is killed at once.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOT = (
    f"import sys; sys.path.insert(0, {_ROOT!r}); "
    "from verify.launching.zygote import serve; serve(int(sys.argv[1]))"
)
# torch._dynamo: PyTorch's DDP imports it when constructed, and optimizers when they first
# step: ~1.7 s of CPU that every rank would pay again after the fork.
_PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.optim",
    "verify.launching.rank", "verify.checks.cells",
)  # fmt: skip
_MAX_MSG = 1 << 20

# The zygote dies with the tool through PR_SET_PDEATHSIG, which fires when the *thread* that
# started it exits, not the process: a zygote started from a pool thread (a check run among
# others in threads) would be SIGKILLed when that pool shut down, and every later launch
# would start fresh interpreters. So zygotes are started by one daemon thread, which lasts
# until the process ends (a pool's worker would not: pools are shut down at interpreter exit,
# before the program's other threads are waited for).
_starts: queue.SimpleQueue = queue.SimpleQueue()
_starter: threading.Thread | None = None


def _start_process(*args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(*args, **kwargs)`, run by the lasting starter thread (called under
    `Zygote._class_lock`, so the thread is started once)."""
    global _starter
    if _starter is None:
        _starter = threading.Thread(target=_serve_starts, name="ddp-verify-zygote-starter",
                                    daemon=True)  # fmt: skip
        _starter.start()
    done, box = threading.Event(), []
    _starts.put((args, kwargs, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _serve_starts() -> None:
    while True:
        args, kwargs, box, done = _starts.get()
        try:
            box.append(subprocess.Popen(*args, **kwargs))
        except BaseException as exc:  # handed back to the caller
            box.append(exc)
        done.set()


class Zygote:
    """The tool's side: ask for a rank, learn its exit status (module docstring)."""

    _instances: dict[frozenset, Zygote | None] = {}  # None: it never worked, do not retry
    _failed = False
    REPLY_S = 30.0  # how long `spawn` waits for the zygote's answer
    MARGIN_S = 5.0  # the zygote refuses a request this long before the tool stops waiting
    _class_lock = threading.Lock()

    @classmethod
    def get(cls, import_env: dict[str, str] | None = None) -> Zygote | None:
        """The process's zygote for these import-time variables, started on first use; None
        if it cannot run here. One that died after it had forked ranks (the OOM killer, say)
        is replaced; one that died before forking any (its preload failed) is not retried."""
        key = frozenset((import_env or {}).items())
        with cls._class_lock:
            old = cls._instances.get(key)
            if old is not None and old.gone():
                old.close()
                cls._instances[key] = None
                if old.forked:
                    del cls._instances[key]
            if key not in cls._instances and not cls._failed:
                try:
                    cls._instances[key] = cls(dict(key))
                except (OSError, RuntimeError):  # RuntimeError: no new thread at shutdown
                    cls._failed = True
            return cls._instances.get(key)

    def __init__(self, import_env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, **import_env, "OPENBLAS_NUM_THREADS": "1"}
        env["ZYGOTE_PARENT"] = str(os.getpid())
        try:
            self.proc = _start_process(
                [sys.executable, "-c", _BOOT, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                # Nothing it says may reach the tool's stdout (a --json document); each rank
                # it forks points its own output at its log file first thing.
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one request at a time
        self.changed = threading.Condition()
        self.exits: dict[int, int] = {}
        self.replies: dict[int, int | None] = {}
        self.alive = True
        self.forked = False  # it has forked a rank: it worked here once
        self.abandoned: set[int] = set()  # requests `spawn` stopped waiting for
        self._next = 0
        threading.Thread(target=self._read, name="ddp-verify-zygote", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def gone(self) -> bool:
        """Dead: its socket closed, or its process already exited (the reader may lag)."""
        return not self.alive or self.proc.poll() is not None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def spawn(
        self,
        job_path: str,
        env: dict,
        log_path: str,
        report_fd: int,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> int | None:
        """Fork a rank running `rank.main(job_path, report_fd)`; its pid, or None if the
        zygote refused or is gone (the caller then starts a fresh interpreter), or when
        `cancelled()` says so while it waits (Ctrl-C: a zygote still importing torch on a
        crowded machine can take many seconds to answer)."""
        deadline = time.monotonic() + self.REPLY_S - self.MARGIN_S
        with self.lock:
            self._next += 1
            ident = self._next
            request = pickle.dumps((ident, deadline, job_path, env, log_path, os.getcwd()))
            try:
                socket.send_fds(self.sock, [request], [report_fd])
            except OSError:
                return None
        end = time.monotonic() + self.REPLY_S
        with self.changed:
            try:
                while not (ident in self.replies or not self.alive):
                    left = end - time.monotonic()
                    if left <= 0 or cancelled():
                        self.abandoned.add(ident)  # a late rank is killed on arrival (`_read`)
                        break
                    self.changed.wait(min(left, 0.1))
            except BaseException:  # KeyboardInterrupt raised in the wait: given up on too
                if ident not in self.replies:
                    self.abandoned.add(ident)
                raise
            return self.replies.pop(ident, None)

    def exitcode(self, pid: int) -> int | None:
        """The rank's exit status as Popen gives it (negative: killed by that signal). A rank
        of a zygote that is gone died with it (PR_SET_PDEATHSIG: SIGKILL)."""
        with self.changed:
            return self.exits.get(pid, None if self.alive else -signal.SIGKILL)

    def wait(self, pid: int, timeout: float) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.exits or not self.alive, timeout=timeout)
        return self.exitcode(pid)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MSG)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self.alive = False
                    self.changed.notify_all()
                    return
                kind, a, b = pickle.loads(data)
                if kind == "started" and a in self.abandoned:
                    self.abandoned.discard(a)
                    if b is not None:  # its place is taken by a fresh interpreter
                        # The process itself first: it may not have made its own group yet.
                        for kill in (os.kill, os.killpg):
                            with contextlib.suppress(OSError):
                                kill(b, signal.SIGKILL)
                elif kind == "started":
                    self.replies[a] = b
                    self.forked = self.forked or b is not None
                else:
                    self.exits[a] = b
                self.changed.notify_all()


# ------------------------------------------------------------ inside the zygote


def serve(fd: int) -> None:
    """The zygote's loop: preload, then fork a rank per request and report exits."""
    parent = int(os.environ.pop("ZYGOTE_PARENT"))
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
    for name in _PRELOAD:
        __import__(name)
    sock = socket.socket(fileno=fd)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock, children)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 4)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)  # the tool is gone
        ident, deadline, job_path, env, log_path, cwd = pickle.loads(data)
        late = time.monotonic() > deadline  # the tool may have given up: never a second rank
        pid = (
            None if late or not _one_thread() else _fork(sock, job_path, env, log_path, cwd, fds[0])
        )
        for f in fds:
            os.close(f)
        if pid is not None:
            children.add(pid)
        _send(sock, ("started", ident, pid))


def _fork(sock, job_path: str, env: dict, log_path: str, cwd: str, report_fd: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the rank: nothing here may return into the zygote's loop
        sock.close()
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from verify.launching import rank

        rank.main(job_path, report_fd, parent=os.getppid())
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(sock, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _send(sock, ("exit", pid, code))


def _one_thread() -> bool:
    return len(os.listdir("/proc/self/task")) == 1 if os.path.isdir("/proc/self/task") else False


def _send(sock, message: tuple) -> None:
    with contextlib.suppress(OSError):
        sock.send(pickle.dumps(message))
