"""The one launcher every multi-process run goes through.

``launch(fn, world_size=N)`` runs ``fn(ctx, *args)`` in N ranks with an initialized process
group and returns a ``LaunchResult`` with one ``RankOutcome`` per rank. The parent guarantees:

- Ranks are spawned (never forked), one process each, world size 1 included. They meet at
  a ``file://`` store in a fresh temp dir, so any number of launches (``pytest -n auto``,
  threads) can run at once: there is no port to collide on.
- Each rank sends back its return value (pickled, returned exactly) or its formatted
  traceback. Failures come back as data, never as an exception out of ``launch``.
- On the first failure (a rank raised, or died without reporting) the others get a short
  grace to finish or fail too, then are killed. ``timeout_s`` after every rank has joined
  the process group (starting the interpreters under load is not fn's time; it has its own
  allowance), every live rank's Python stack is dumped (faulthandler on SIGUSR1), then all
  are killed.
- No process is left behind: the parent kills and reaps every rank in a ``finally`` (also
  on Ctrl-C) and at interpreter exit, and on Linux each rank dies with its parent
  (PR_SET_PDEATHSIG), even if the parent is SIGKILLed.

- A watchdog sees every rank's progress: each rank traces its collectives (``tracer.py``)
  into a file the parent polls. When no rank has issued or completed a collective for
  ``stall_timeout_s`` while one waits in a collective, the run is declared hung at once
  (rather than at ``timeout_s``): stacks are dumped, every rank is killed, and
  ``LaunchResult.diagnosis`` (``diagnose.py``) names the culprit rank, the collective and the
  call site. A rank that is merely slow (it computes, and resumes issuing collectives within
  the stall timeout) is never flagged. The same records are compared after every run, so
  collectives that completed but disagreed (SUM vs MAX) come back as a "desync" diagnosis.

Under ``torchrun`` (RANK, WORLD_SIZE and MASTER_ADDR set) nothing is spawned: this process
is one rank, and every rank receives the full result through the job's key-value store (not a
collective, which a rank still inside fn's collectives could mis-pair with); a rank that failed
waits a short grace for the others, then closes its process group so peers blocked on it fail
and report too.

fn must be a module-level (picklable) function, and it must call collectives in the same
order on all ranks, or it hangs until ``stall_timeout_s`` (and is diagnosed).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verify.watching import capture

from verify.watching import tracer
from verify.watching.diagnose import Diagnosis, RankState, diagnose

_SPAWNED_ENV = "DDP_VERIFY_SPAWNED"  # marks our children: they must not mistake us for torchrun
_GRACE_S = 1.5  # after a failure, peers usually error out within ms (their sockets close)
_POLL_S = 0.05
_STACK_WAIT_S = 0.5
_EXIT_WAIT_S = 5.0  # ranks that reported may take a moment to tear down and exit
_STARTUP_S = 60.0  # to start every interpreter and meet; 2 ranks take ~1.5 s on 2 idle cores
# The parent's deadline must come first, so a hang yields stacks rather than a gloo error.
_PG_TIMEOUT_SLACK_S = 10.0
_STDERR_ENV = "DDP_VERIFY_RANK_STDERR"  # "inherit": ranks write to the terminal, not a file
_STDERR_TAIL_BYTES = 8192
# No collective issued or completed by any rank for this long, while one waits: a hang. Long
# enough for any legitimate imbalance in this project's workloads (a rank computing a reference
# while the others wait), short enough that CI learns of a hang in a minute, with a diagnosis.
DEFAULT_STALL_TIMEOUT_S = 60.0
STALL_ENV = "DDP_VERIFY_STALL_TIMEOUT"  # ranks can read their stall timeout (scenarios do)
_LIVE: set[mp.Process] = set()  # every child not yet reaped, for the atexit cleanup
_ENV_LOCK = threading.Lock()


@dataclass(frozen=True)
class RankContext:
    """What fn receives in each rank, after the process group is initialized."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # cpu for gloo; cuda:{local_rank} for nccl
    backend: str
    spawned: bool  # False when this process joined an existing torchrun job


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended. ``error`` is a one-line reason for every status but "ok"."""

    rank: int
    status: str  # "ok" | "error" | "crashed" | "timeout" | "killed"
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None  # negative: killed by that signal
    stack: str | None = None  # faulthandler dump (timeout, killed, or a fatal signal)
    stderr: str | None = None  # the last lines the rank wrote to stdout+stderr (failed ranks only)


@dataclass(frozen=True)
class LaunchResult:
    world_size: int
    outcomes: tuple[RankOutcome, ...]  # indexed by rank
    elapsed_s: float
    timed_out: bool
    failure_order: tuple[int, ...] = ()  # ranks that raised or crashed, root cause first
    stalled: bool = False  # the watchdog ended the run: no rank progressed for the stall timeout
    diagnosis: Diagnosis | None = None  # from the collective traces (None: tracing was off)

    @property
    def ok(self) -> bool:
        return all(o.status == "ok" for o in self.outcomes)

    @property
    def values(self) -> list:
        if not self.ok:
            raise RuntimeError(self.summary())
        return [o.value for o in self.outcomes]

    @property
    def first_failure(self) -> RankOutcome | None:
        """The root cause: the rank that failed first, not the ones killed after it."""
        if self.failure_order:
            return self.outcomes[self.failure_order[0]]
        failed = [o for o in self.outcomes if o.status != "ok"]  # a timeout: lowest rank
        return min(failed, key=lambda o: (o.status == "killed", o.rank), default=None)

    def summary(self) -> str:
        """A short diagnosis: which rank failed how and where."""
        diag = self.diagnosis
        if self.ok:
            ok = f"ok: {self.world_size} rank(s) finished in {self.elapsed_s:.1f}s"
            return ok + (f"\nbut {diag.text()}" if diag is not None and diag.faulty else "")
        if self.stalled and diag is not None:
            return diag.text()
        base = self._failure_summary()
        if diag is not None and diag.faulty and diag.collective is not None:
            return f"{base}\ncollective trace says: {diag.text()}"
        return base

    def _failure_summary(self) -> str:
        if self.timed_out:
            lines = [f"timed out after {self.elapsed_s:.1f}s; innermost frames per rank:"]
            for o in self.outcomes:
                where = _innermost_frames(o.stack) if o.stack else o.error or ""
                lines.append(f"  rank {o.rank} [{o.status}]: {where}")
            return "\n".join(lines)
        root = self.first_failure
        assert root is not None
        lines = [f"rank {root.rank} failed ({root.status}): {root.error}"]
        if root.traceback:
            lines += _user_frame(root.traceback)
        elif root.stack:
            lines.append(f"  at {_innermost_frames(root.stack)}")
        if root.stderr and not root.traceback:
            # A rank killed by the backend (gloo's enforce failures abort the process) says why
            # only on its stderr.
            lines.append("  its stderr ended with:")
            lines += [f"    {line}" for line in _last_lines(root.stderr)]
        others = [f"{o.rank} {o.status}" for o in self.outcomes if o.rank != root.rank]
        return "\n".join(lines + (["other ranks: " + ", ".join(others)] if others else []))


def launch(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    report_dir: str | None = None,
) -> LaunchResult:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; the module docstring has the contract.

    Args:
        fn: module-level function ``fn(ctx: RankContext, *args)``; its return value must pickle.
        world_size: number of ranks (must equal WORLD_SIZE when joining torchrun).
        args: extra positional arguments for fn, pickled to every rank.
        timeout_s: how long fn may run once every rank is up (spawning comes on top).
        backend: "gloo" (CPU) or "nccl" (one GPU per rank).
        env: extra environment variables for the ranks, set before their interpreter starts.
        stall_timeout_s: declare a hang when no rank issued or completed a collective for this
            long while one waits in a collective; None turns tracing and the watchdog off.
        report_dir: keep every rank's stderr, stack dump and collective trace in this (existing)
            directory, and ask the ranks for the backend's flight-recorder dump at a hang.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0 or None, got {stall_timeout_s}")
    joining = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    if joining and _SPAWNED_ENV not in os.environ:
        return _join_torchrun(fn, args, world_size, timeout_s, backend, env or {})
    gpus = torch.cuda.device_count() if backend == "nccl" and torch.cuda.is_available() else 0
    if backend == "nccl" and world_size > gpus:
        raise ValueError(f"backend 'nccl' needs a CUDA device per rank: {world_size} > {gpus}")
    try:
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(f"fn must be module-level and args picklable: {_one_line(exc)}") from exc
    return _spawn(payload, world_size, timeout_s, backend, env or {}, stall_timeout_s, report_dir)


# ------------------------------------------------------------ parent side (spawned ranks)


def _spawn(payload, world_size, timeout_s, backend, env, stall_timeout_s, report_dir):
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="ddp-verify-")
    init_method = "file://" + os.path.join(tmpdir, "rendezvous")
    keep = report_dir or tmpdir
    stack_paths = [os.path.join(keep, f"rank{r}.stack") for r in range(world_size)]
    stderr_paths = [os.path.join(keep, f"rank{r}.stderr") for r in range(world_size)]
    trace_paths = [None] * world_size
    if stall_timeout_s is not None:
        trace_paths = [os.path.join(keep, f"rank{r}.trace") for r in range(world_size)]
    if os.environ.get(_STDERR_ENV) == "inherit":
        stderr_paths = [None] * world_size
    start = time.monotonic()
    child_env = {_SPAWNED_ENV: "1", **env}
    if stall_timeout_s is not None:
        child_env[STALL_ENV] = repr(stall_timeout_s)
    if "GLOO_SOCKET_IFNAME" not in {**os.environ, **env}:
        # Gloo binds to whatever the hostname resolves to; our ranks are all local.
        child_env["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
    pg_timeout = _STARTUP_S + timeout_s + _PG_TIMEOUT_SLACK_S
    common = (payload, world_size, backend, init_method, pg_timeout, os.getpid(), report_dir)
    procs: list[mp.Process] = []
    conns = []
    try:
        with _environ(child_env):  # inherited at exec, so import-time variables work too
            for rank in range(world_size):
                recv_end, send_end = ctx.Pipe(duplex=False)
                conns.append(recv_end)
                paths = (stack_paths[rank], stderr_paths[rank], trace_paths[rank])
                rank_args = (rank, common, paths, send_end)
                proc = ctx.Process(target=_rank_main, args=rank_args, name=f"rank{rank}")
                proc.start()
                procs.append(proc)
                _LIVE.add(proc)
                send_end.close()  # only the child holds it now: EOF means the rank is gone
        watchdog = capture.Watchdog(trace_paths, stall_timeout_s) if stall_timeout_s else None
        outcomes, order, timed_out = _supervise(
            procs, conns, stack_paths, timeout_s, watchdog, report_dir
        )
        if all(o.status in ("ok", "error") for o in outcomes):  # all reported: let them exit
            until = time.monotonic() + _EXIT_WAIT_S
            for proc in procs:
                proc.join(max(0.0, until - time.monotonic()))
    finally:
        _kill(procs)
        for conn in conns:
            conn.close()
        stderrs = [_read_tail(path) if path else None for path in stderr_paths]
        traces = [tracer.read_trace(path) if path else None for path in trace_paths]
        shutil.rmtree(tmpdir, ignore_errors=True)
    outcomes = [
        replace(o, exitcode=p.exitcode, stderr=None if o.status == "ok" else err)
        for o, p, err in zip(outcomes, procs, stderrs, strict=True)
    ]
    stalled = watchdog is not None and watchdog.stalled_at is not None
    diagnosis = None
    if watchdog is not None:
        diagnosis = _diagnose(outcomes, traces, order, timed_out, watchdog)
    elapsed = time.monotonic() - start
    return LaunchResult(world_size, tuple(outcomes), elapsed, timed_out, order, stalled, diagnosis)


def _diagnose(outcomes, traces, order, timed_out, watchdog) -> Diagnosis:
    """Compare the ranks' records; the root-cause rank (if any) goes first."""
    states = [
        RankState(o.rank, o.status, o.error, o.traceback, o.stack, o.exitcode, o.stderr)
        for o in outcomes
    ]
    return diagnose(
        traces,
        states,
        stalled=watchdog.stalled_at is not None or timed_out,
        stall_timeout_s=watchdog.stall_timeout_s,
        detection_s=watchdog.detection_s() if (order or timed_out) else None,
        failure_order=order,
    )


def _supervise(procs, conns, stack_paths, timeout_s, watchdog=None, report_dir=None):
    """Poll until every rank reported or exited, the grace after a failure ran out, the
    deadline passed, or the watchdog saw a stall; label the ranks still running then."""
    n = len(procs)
    outcomes: list[RankOutcome | None] = [None] * n
    failures: list[tuple[float, int]] = []  # (when, rank)
    up: set[int] = set()  # ranks that joined the process group
    deadline, grace_end = time.monotonic() + _STARTUP_S, float("inf")
    while None in outcomes and time.monotonic() < min(deadline, grace_end):
        if watchdog is not None and len(up) == n and not failures and watchdog.poll():
            break
        pending = [r for r, o in enumerate(outcomes) if o is None]
        # A crash is only known to have happened after the previous poll; dating it there
        # keeps it ahead of the "connection closed by peer" errors it causes in the others.
        alive_at = time.time()
        wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], _POLL_S)
        for r in pending:
            # Sampled before draining: a rank that had exited by now has all it sent in the
            # pipe, so only one that really never reported is declared crashed below.
            exited = not procs[r].is_alive()
            while outcomes[r] is None and (msg := _receive(conns[r])) is not None:
                up.add(r)
                if msg[0] == "up":
                    if len(up) == n:  # fn's clock starts now
                        deadline = time.monotonic() + timeout_s
                    continue
                outcomes[r], failed_at = _outcome(r, msg)
                if failed_at is not None:
                    failures.append((failed_at, r))
            if outcomes[r] is None and exited:  # exited without a report
                why = _describe_exit(procs[r].exitcode) + " before reporting"
                stack = _read(stack_paths[r])  # faulthandler wrote there if a fatal signal hit
                outcomes[r] = RankOutcome(r, "crashed", error=why, stack=stack)
                failures.append((alive_at, r))
        if failures:
            grace_end = min(grace_end, time.monotonic() + _GRACE_S)
    order = _root_cause_order(failures, outcomes)
    leftover = [r for r, o in enumerate(outcomes) if o is None]
    stalled = watchdog is not None and watchdog.stalled_at is not None
    if report_dir is not None and leftover:
        capture.request_flight_recorder(report_dir, [r for r in leftover if procs[r].is_alive()])
    stacks = _dump_stacks(procs, leftover, stack_paths)
    timed_out = bool(leftover) and not failures
    for r in leftover:
        if stalled:
            why = f"no rank progressed for {watchdog.stall_timeout_s:g}s (stall timeout)"
        elif not timed_out:
            why = f"still running {_GRACE_S:g}s after rank {order[0]} failed"
        elif len(up) < n:
            why = f"the ranks were not all up after {_STARTUP_S:g}s"
        else:
            why = f"still running {timeout_s:g}s after all ranks were up"
        status = "timeout" if timed_out else "killed"
        outcomes[r] = RankOutcome(r, status, error=why, stack=stacks[r])
    return outcomes, order, timed_out


def _receive(conn) -> tuple | None:
    """The next message from a rank if one is waiting; None if none is, or the pipe is closed
    (the rank died)."""
    try:
        return pickle.loads(conn.recv_bytes()) if conn.poll() else None
    except (EOFError, OSError):
        return None


def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    with contextlib.suppress(ValueError):
        return f"killed by {signal.Signals(-code).name}"
    return f"killed by signal {-code}"


def _outcome(rank: int, report: tuple) -> tuple[RankOutcome, float | None]:
    """A rank's report as (outcome, failure time or None)."""
    if report[0] == "ok":
        try:
            return RankOutcome(rank, "ok", value=pickle.loads(report[1])), None
        except Exception as exc:
            why = f"the return value could not be unpickled here: {_one_line(exc)}"
            report = ("error", why, traceback.format_exc(), time.time())
    status, error, tb, failed_at = report  # "error", or "crashed" for a rank lost in a join
    return RankOutcome(rank, status, error=error, traceback=tb), failed_at


def _root_cause_order(failures: list[tuple[float, int]], outcomes) -> tuple[int, ...]:
    """Failed ranks, root cause first: by time, except that a collective which failed because
    a peer vanished is an echo of that peer's failure, so it goes last whatever its time."""
    echo = re.compile(r"closed by peer|reset by peer|remote worker|Broken pipe|did not take part")
    key = {r: (bool(echo.search(outcomes[r].error or "")), t) for t, r in failures}
    return tuple(sorted(key, key=key.__getitem__))


def _dump_stacks(procs, ranks, stack_paths) -> dict[int, str | None]:
    """Ask each live rank for a faulthandler dump of all its threads, then read them."""
    asked = []
    for r in ranks:
        # The file appears only once the handler is registered: before that, SIGUSR1 kills.
        if procs[r].is_alive() and os.path.exists(stack_paths[r]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, signal.SIGUSR1)
                asked.append(r)
    end, sizes = time.monotonic() + _STACK_WAIT_S, None
    while asked and time.monotonic() < end:
        time.sleep(0.05)
        sizes, before = [os.path.getsize(stack_paths[r]) for r in asked], sizes
        if all(sizes) and sizes == before:  # written and no longer growing
            break
    return {r: _read(stack_paths[r]) for r in ranks}


def _kill(procs) -> None:
    """SIGTERM, a short wait, then SIGKILL; every process is reaped on return."""
    live = [p for p in procs if p.is_alive()]
    for proc in live:
        proc.terminate()
    end = time.monotonic() + 0.5
    for proc in live:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
        # The rank led its own process group (os.setsid in _rank_main): end what it started.
        with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
            os.killpg(proc.pid, signal.SIGKILL)
        _LIVE.discard(proc)


atexit.register(lambda: _kill(list(_LIVE)))  # e.g. a launch in a thread when the main exits


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """Set variables for children started inside; the lock keeps concurrent launches apart."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v


def _loopback_ifname() -> str:
    return next((n for _, n in socket.if_nameindex() if n.startswith("lo")), "lo")


# ------------------------------------------------------------ inside a spawned rank


def _rank_main(rank: int, common: tuple, paths: tuple, conn) -> None:
    payload, world_size, backend, init_method, pg_timeout, ppid, report_dir = common
    stack_path, stderr_path, trace_path = paths
    if stderr_path is not None:
        # Everything this rank writes to fd 2 (Python warnings, and the C++ backend's abort
        # messages, which never reach Python) goes to a file the parent reads on failure.
        # stdout goes there too: a user's print() must not corrupt the parent's --json output.
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.dup2(fd, 1)
        os.close(fd)
    with contextlib.suppress(OSError):
        # A process group of its own: anything the rank starts is killed with it (_kill).
        os.setsid()
    if sys.platform.startswith("linux"):  # die with the parent, even if it is SIGKILLed
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != ppid:  # the parent died before prctl took effect
        os._exit(1)
    stack_file = open(stack_path + ".tmp", "w")  # noqa: SIM115 - faulthandler keeps it open
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=stack_file, all_threads=True)  # fatal signals dump there too
    os.replace(stack_path + ".tmp", stack_path)  # from now on the parent may send SIGUSR1
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if "OMP_NUM_THREADS" not in os.environ:  # the ranks share the cores: don't oversubscribe
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        torch.set_num_threads(max(1, (cores or os.cpu_count() or 1) // world_size))
    try:
        fn, args = pickle.loads(payload)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=pg_timeout)
        if report_dir is not None:
            capture.start_rank_helper(report_dir, rank, backend)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        if trace_path is not None:
            tracer.install(trace_path, rank=rank)
        conn.send_bytes(pickle.dumps(("up",)))  # starts the parent's timeout_s clock
        report = _call(fn, RankContext(rank, world_size, rank, device, backend, True), args)
    except BaseException as exc:  # e.g. fn's module failed to import here
        report = _error_report(exc)
    try:
        with contextlib.suppress(OSError):  # the parent is gone: nobody to tell
            conn.send_bytes(pickle.dumps(report))
    finally:  # report first, so a failure reaches the parent before peers see us leave
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _call(fn, ctx: RankContext, args: tuple) -> tuple:
    """Run fn: ("ok", pickled value), or an error report (unpicklable values included)."""
    try:
        return ("ok", pickle.dumps(fn(ctx, *args), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures of fn too
        return _error_report(exc)


def _error_report(exc: BaseException) -> tuple:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ("error", _one_line(exc), tb, time.time())


# ------------------------------------------------------------ joining a torchrun job


def _join_torchrun(fn, args, world_size, timeout_s, backend, env) -> LaunchResult:
    if world_size != int(os.environ["WORLD_SIZE"]):
        raise ValueError(
            f"world_size={world_size} but torchrun has WORLD_SIZE={os.environ['WORLD_SIZE']}"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if backend == "nccl":
        if not (torch.cuda.is_available() and local_rank < torch.cuda.device_count()):
            raise ValueError(f"backend 'nccl' needs a CUDA device for LOCAL_RANK={local_rank}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    os.environ.update(env)  # best effort: this interpreter started long ago
    start = time.monotonic()
    created = not dist.is_initialized()
    if created:
        timeout = datetime.timedelta(seconds=timeout_s)  # the only hang guard without a parent
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    global _JOINS
    _JOINS += 1  # every rank calls launch() in the same order: the n-th launch's keys
    prefix = f"ddp-verify/launch{_JOINS}/"
    try:
        report = _call(fn, RankContext(rank, world_size, local_rank, device, backend, False), args)
        reports = _exchange(prefix, rank, world_size, report, timeout_s, created)
    finally:
        if created:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    pairs = [_outcome(r, rep) for r, rep in enumerate(reports)]
    outcomes = tuple(o for o, _ in pairs)
    order = _root_cause_order([(t, r) for r, (_, t) in enumerate(pairs) if t is not None], outcomes)
    return LaunchResult(world_size, outcomes, time.monotonic() - start, False, order)


_JOINS = 0


def _exchange(prefix, rank, world_size, report, timeout_s, created) -> list:
    """Every rank's report, through the job's key-value store rather than a collective: a
    rank still inside fn's collectives cannot be mis-paired with the exchange, and a rank that
    failed does not wait for the process-group timeout. It waits a grace for its peers, then
    (if it created the group) destroys it, which makes peers blocked on it fail at once and
    report, and waits for their reports for at most `timeout_s`."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{prefix}{rank}", pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))
    keys = [f"{prefix}{r}" for r in range(world_size)]
    waits = [timeout_s]
    if report[0] != "ok":
        waits = [_GRACE_S, timeout_s]
    for i, wait_s in enumerate(waits):
        try:
            store.wait(keys, datetime.timedelta(seconds=wait_s))
            break
        except Exception:
            if i == 0 and len(waits) > 1 and created:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
    reports = []
    for r, key in enumerate(keys):
        if r == rank:
            reports.append(report)
            continue
        try:
            # check() first: get() on a missing key would block for the store's own timeout.
            reports.append(pickle.loads(store.get(key)) if store.check([key]) else None)
        except Exception:
            reports.append(None)
    lost = ("crashed", f"did not report within {timeout_s:g}s", None, time.time())
    return [rep if rep is not None else lost for rep in reports]


# ------------------------------------------------------------ formatting


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__


def _read_tail(path: str) -> str | None:
    """The last few KB of a rank's stderr file (None if it wrote nothing)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - _STDERR_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return text or None


def _last_lines(text: str, count: int = 3) -> list[str]:
    """The last `count` non-blank lines, without the noise of torch's import-time warnings."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if "_conversion_method_template" not in line]
    return lines[-count:]


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read() or None
    return None


_TB_FRAME = re.compile(r'^  File "(.+)", line \d+, in ')
_NOT_USER = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__), __file__)


def _user_frame(tb: str) -> list[str]:
    """The innermost traceback frame outside torch, the stdlib and this file, with its line."""
    lines = tb.splitlines() + [""]
    frames = [i for i, line in enumerate(lines) if _TB_FRAME.match(line)]
    users = [i for i in frames if not _TB_FRAME.match(lines[i]).group(1).startswith(_NOT_USER)]
    if not frames:
        return []
    i = (users or frames)[-1]
    return [lines[i]] + ([lines[i + 1]] if lines[i + 1].startswith("    ") else [])


def _innermost_frames(stack: str, depth: int = 3) -> str:
    """'f (file:line) <- g (file:line)' for the thread that runs fn (the one in _rank_main)."""
    threads = [t for t in stack.split("\n\n") if "most recent call first" in t]
    main = next((t for t in threads if " in _rank_main" in t), threads[0] if threads else "")
    frames = []
    for path, line, name in re.findall(r'File "(.+)", line (\d+) in (\S+)', main):
        if name in ("_call", "_rank_main"):  # below is launcher and multiprocessing plumbing
            break
        if name != "wrapper":  # torch's c10d logging decorator
            frames.append(f"{name} ({os.path.basename(path)}:{line})")
    return " <- ".join(frames[:depth])
