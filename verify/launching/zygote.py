"""The zygotes: interpreters that have imported torch once and fork ranks, one a rank index.

Why: a fresh interpreter spends ~2 s of CPU importing torch before a rank does anything; the
checks and the test suite start hundreds of ranks. A rank forked from a process that already
imported torch starts in milliseconds. (A zygote is one such import: it pays off from the
second rank it forks.)

Why one a rank index (rank r of every launch of this process forks from rank r's): ranks
forked from one process would share what fresh interpreters draw each their own, and a
verdict must be the one a real launch earns. Their hash seeds would be one, and so would their
heaps' layout: a set of parameters (`set(module.parameters())`, a student's way to reduce a
tied weight once) iterates by address, so it would run in one order on every rank, and a
class whose ranks all-reduce in different orders passed (a size mismatch with fresh
interpreters: tests/test_launch.py). From zygotes of their own, the ranks' orders differ as
fresh interpreters' do; now and then two coincide, as two fresh interpreters' may.

Why it is safe: `fork` copies one thread, so it is safe only in a process that has one thread
and no state a thread or a device would hold. The zygote imports torch and this tool's modules
and nothing else happens in it: no tensor operation (OpenMP and MKL start their threads at the
first parallel region, in the rank), no CUDA, no process group; numpy's OpenBLAS, which starts
a thread at import, is held to one thread (OPENBLAS_NUM_THREADS=1). Before every fork it
checks that it still has exactly one thread, and refuses (the launcher then starts a fresh
interpreter) otherwise.

When it is used: function ranks on gloo (`spawn.launch`), and a user's script's ranks on a
machine without a GPU from a process's second launch of a script on (`script.run_script`).
Variables torch reads when it is imported (TORCH_CPP_LOG_LEVEL, TORCH_DISTRIBUTED_DEBUG: the
hang report's debug logs) cannot be set after the fork, so each set of them gets zygotes of
its own, started with them.

A script must find what `python train.py` would give it, and a fork shares what a fresh
interpreter draws afresh. Besides the zygote a rank above (the hash seeds and heaps differ as
fresh interpreters' do), torch's CPU generator is seeded again in the rank
(`rank_script.py`), Python's `random` is at every fork, numpy's global generator is made in the
rank. (A function rank's generator is the trainer's to seed, rank by rank.) A script's zygote
imports only what a fresh rank imports before the script anyway (`_SCRIPT_PRELOAD`), and the
forked rank ends as an interpreter does (`zygote_serve.py`). tests/test_launch.py runs one
probe both ways and compares what it saw.

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
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from verify.launching.env import NO_ZYGOTE_ENV
from verify.launching.zygote_serve import MAX_MSG

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOT = (
    f"import sys; sys.path.insert(0, {_ROOT!r}); "
    "from verify.launching.zygote_serve import serve; serve(int(sys.argv[1]), sys.argv[2:])"
)
# Variables torch may read when it is imported: a launch that sets them forks its ranks from a
# zygote started with them (the thread budget's are applied in the rank, after the fork).
_READ_AT_IMPORT = ("TORCH_", "NCCL_", "PYTORCH_", "CUDA_", "OMP_", "KMP_", "MKL_", "GLOO_")
# What a zygote imports before it forks. A function rank's: torch._dynamo as well, which
# PyTorch's DDP imports when constructed and optimizers when they first step (~1.7 s of CPU
# that every rank would pay again after the fork).
_PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.optim",
    "verify.launching.rank", "verify.checks.cells",
)  # fmt: skip
# A script rank's: torch and the rank's modules, what a fresh interpreter imports before the
# script too (`rank_script.py`), and no more. With torch._dynamo imported before the fork, a
# script rank that returned while its peer was still in DDP's all-reduce deadlocked at exit in
# about one run in three under load (the uneven shards of tests/test_evidence.py): its main
# thread, holding the GIL, joined a gloo worker in `~ProcessGroupGloo`, and the worker waited
# for the GIL to drop the last reference to the context `backward()` stashes in its thread
# state. Never in twelve runs with fresh interpreters nor in twenty with this preload: that
# race of PyTorch's stays as rare as a fresh interpreter has it.
_SCRIPT_PRELOAD = ("torch", "torch.distributed", "verify.launching.rank")

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

    _instances: dict[tuple, Zygote | None] = {}  # None: it never worked, do not retry
    REPLY_S = 30.0  # how long `spawn` waits for the zygote's answer
    MARGIN_S = 5.0  # the zygote refuses a request this long before the tool stops waiting
    _class_lock = threading.Lock()

    @classmethod
    def for_launch(
        cls, env: dict[str, str] | None, nproc: int, *, script: bool = False
    ) -> list[Zygote | None]:
        """The zygote of each of a CPU launch's `nproc` ranks, rank r's at [r] (module
        docstring: one a rank index), given the variables the launch adds to the ranks'
        environment (those torch reads at import choose them) and whether it runs a user's
        `script` (which preloads less). None for a rank none can fork here; none at all when
        `DDP_VERIFY_NO_ZYGOTE=1` asks for fresh interpreters."""
        if os.environ.get(NO_ZYGOTE_ENV) == "1":
            return []
        import_env = {k: v for k, v in (env or {}).items() if k.startswith(_READ_AT_IMPORT)}
        preload = _SCRIPT_PRELOAD if script else _PRELOAD
        return [cls.get(import_env, preload, rank) for rank in range(nproc)]

    @classmethod
    def get(
        cls,
        import_env: dict[str, str] | None = None,
        preload: tuple[str, ...] = _PRELOAD,
        slot: int | None = None,
    ) -> Zygote | None:
        """The process's zygote for these import-time variables, this preload and this `slot`
        (a rank index), started on first use; None if it cannot run here. One that died after
        it had forked ranks (the OOM killer, say) is replaced; one that died before forking
        any (its preload failed), or could not start, is not retried."""
        key = (frozenset((import_env or {}).items()), preload, slot)
        with cls._class_lock:
            old = cls._instances.get(key)
            if old is not None and old.gone():
                old.close()
                cls._instances[key] = None
                if old.forked:
                    del cls._instances[key]
            if key not in cls._instances:
                try:
                    cls._instances[key] = cls(dict(key[0]), preload)
                except (OSError, RuntimeError):  # RuntimeError: no new thread at shutdown
                    cls._instances[key] = None  # this one is not retried; the others may be
            return cls._instances.get(key)

    def __init__(self, import_env: dict[str, str], preload: tuple[str, ...] = _PRELOAD) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, **import_env, "OPENBLAS_NUM_THREADS": "1"}
        env["ZYGOTE_PARENT"] = str(os.getpid())
        try:
            self.proc = _start_process(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), *preload],
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
        job_fd: int,
        env: dict,
        report_fd: int,
        *,
        out: str | int,
        err: str | int | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> int | None:
        """Fork a rank running `rank.main(job_fd, report_fd)`; its pid, or None if the
        zygote refused or is gone (the caller then starts a fresh interpreter), or when
        `cancelled()` says so while it waits (Ctrl-C: a zygote still importing torch on a
        crowded machine can take many seconds to answer).

        `out` is where the rank's stdout goes: a file's path (made afresh) or the write end
        of a pipe; `err` its stderr, the same way (None: with stdout)."""
        deadline = time.monotonic() + self.REPLY_S - self.MARGIN_S
        fds = [report_fd, job_fd] + [x for x in (out, err) if isinstance(x, int)]
        # a pipe travels as its index among the fds sent, a path as itself
        where = [fds.index(x) if isinstance(x, int) else x for x in (out, err)]
        with self.lock:
            self._next += 1
            ident = self._next
            request = pickle.dumps((ident, deadline, env, where, os.getcwd()))
            try:
                socket.send_fds(self.sock, [request], fds)
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
                data = self.sock.recv(MAX_MSG)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self.alive = False
                    self.changed.notify_all()
                    return
                kind, a, b = pickle.loads(data)
                if kind == "started":  # a pid the system gave again: its old exit is not its
                    self.exits.pop(b, None)
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
