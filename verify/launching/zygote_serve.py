"""Inside the zygote (`zygote.py`): import, then fork a rank per request and report exits.

The zygote is a fresh interpreter started by the tool with `serve`; it imports what its
`preload` names and nothing else happens in it (no tensor operation, no thread, no CUDA), so
a fork of it is a safe start for a rank. Each forked rank is made what a fresh interpreter
would be before it runs the same `rank.main`: a session of its own, Python's signal
handlers, its output where the tool said, stdin from /dev/null, the launch's environment and
working directory; and a script's rank ends as an interpreter ends (`_fork`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import sys
import time

import psutil

MAX_MSG = 1 << 20  # the longest message either side sends
_MAX_FDS = 4  # a request's descriptors: the report pipe, the job's file, stdout's and stderr's


def serve(fd: int, preload: list[str]) -> None:
    """The zygote's loop: preload, then fork a rank per request and report exits."""
    parent = int(os.environ.pop("ZYGOTE_PARENT"))
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
    for name in preload:
        __import__(name)
    sock = socket.socket(fileno=fd)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock, children)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, _MAX_FDS)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)  # the tool is gone
        ident, deadline, env, where, cwd = pickle.loads(data)
        late = time.monotonic() > deadline  # the tool may have given up: never a second rank
        pid = None if late or not _one_thread() else _fork(sock, env, where, cwd, fds)
        for f in fds:
            os.close(f)
        if pid is not None:
            children.add(pid)
        _send(sock, ("started", ident, pid))


def _fork(sock, env: dict, where: list, cwd: str, fds: list[int]) -> int:
    """Fork the rank: `fds` are its report pipe, its job's file, then its output pipes."""
    pid = os.fork()
    if pid:
        return pid
    script, ending = False, SystemExit(1)
    try:  # the rank: nothing here may return into the zygote's loop
        sock.close()
        os.setsid()
        # As a fresh interpreter has them (SIGINT's handler: rank.main, for every rank)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        out, err = where
        _point(1, out, fds)
        if err is None:
            os.dup2(1, 2)  # one file description: the two streams interleave, never overwrite
        else:
            _point(2, err, fds)
        for pipe in {x for x in where if isinstance(x, int)}:
            os.close(fds[pipe])  # held as 1 and 2 now
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from verify.launching import rank

        script = rank.main(fds[1], fds[0], parent=os.getppid()) == "script"
        ending = SystemExit(0)
    except SystemExit as exc:  # a script's sys.exit() (`rank_script.py` raises it again)
        script, ending = True, exc
    except BaseException:
        import traceback

        traceback.print_exc()
    if script:
        # A script's rank ends as `python train.py` ends: the exit rises out of every frame to
        # the top, where Python applies sys.exit's rules (None is 0, an int is itself, anything
        # else is printed and is 1) and finalizes (threads that are not daemons joined, atexit
        # functions run, the modules torn down with their objects' __del__, C++ destructors).
        raise ending
    with contextlib.suppress(Exception):  # the tool's own function: its report is sent
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(ending.code)


def _point(fd: int, to: str | int, fds: list[int]) -> None:
    """Make `fd` (1 or 2) write to `to`: a file's path, made afresh, or the index of a pipe's
    write end among the `fds` the request brought."""
    if isinstance(to, int):
        os.dup2(fds[to], fd)
        return
    target = os.open(to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
    os.dup2(target, fd)
    os.close(target)


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
    """Whether this process has a single thread, which a fork needs (Linux alone: elsewhere the
    zygote has never forked, and each rank starts a fresh interpreter)."""
    return psutil.LINUX and psutil.Process().num_threads() == 1


def _send(sock, message: tuple) -> None:
    with contextlib.suppress(OSError):
        sock.send(pickle.dumps(message))
