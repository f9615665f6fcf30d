"""What a report captures besides the traces: the backend's logs, and answers from the ranks.

- the backend's own debug output is turned on by `launching/env.backend_env`;
- `start_rank_helper` runs a daemon thread in each rank that answers the parent over a
  connection of its own: where the main thread is now (the watchdog names the line a
  computing rank is at), whether it is blocked inside a torch call the trace cannot see (such
  as PyTorch DDP's reducer), and the flight recorder's dump. A thread, because a rank stuck in
  a collective has released the GIL in C++, while its main thread would never run a Python
  signal handler.
- `helpers(folder)` is the parent's end: `RankHelpers.where` and `.in_torch` for the
  watchdog's questions, `RankHelpers.flight_recorder` for the dumps a report keeps.

The channel: each rank's helper listens on loopback and leaves its port and a fresh random key
in `rank<r>.helper` of the run folder, which only this user can read (`private.py`). The parent
connects with that key, and both ends prove they hold it (`multiprocessing.connection`'s
challenge, each way) before a message is read, so another local user who finds the port can
neither ask nor answer. The file is the address, written once; every question and answer goes
over the connection, and an answer sent before the rank died is still read from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import weakref
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)

from verify import private
from verify.watching import stacks

_FR_WAIT_S = 1.0
_WHERE, _FLIGHT_RECORDER = "where", "flight recorder"
ADDRESS = "helper"  # rank<r>.helper: the helper's port and key (not part of a report)


def _path(folder: str, rank: int, what: str) -> str:
    return os.path.join(folder, f"rank{rank}.{what}")


def fr_path(report_dir: str, rank: int) -> str:
    return _path(report_dir, rank, "flight_recorder.json")


def start_rank_helper(folder: str, rank: int) -> None:
    """In a rank: listen for the parent and answer its questions (see the module docstring)
    until exit. Nothing is listened for when the address cannot be left in `folder`."""
    key = os.urandom(32)
    listener = Listener(("127.0.0.1", 0), family="AF_INET", backlog=8)
    address = {"port": listener.address[1], "key": key.hex()}
    try:
        left = private.write(folder, f"rank{rank}.{ADDRESS}", json.dumps(address).encode())
    except (OSError, private.Untrusted):
        left = False
    if not left:
        listener.close()
        return

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return
            # One thread per connection: a peer that never answers the challenge holds only its own.
            threading.Thread(
                target=_answer, args=(conn, key), name="ddp-verify-helper", daemon=True
            ).start()

    threading.Thread(target=accept, name="ddp-verify-helper", daemon=True).start()


def _answer(conn: Connection, key: bytes) -> None:
    """Prove the key each way, then answer each question until the parent hangs up."""
    with conn:
        try:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
            while True:
                question = conn.recv()
                if question == _WHERE:  # the user's line, then whether blocked inside torch
                    conn.send(
                        (_WHERE, stacks.main_thread_site() or "", stacks.main_thread_in_torch())
                    )
                elif question == _FLIGHT_RECORDER:
                    conn.send((_FLIGHT_RECORDER, _flight_recorder_dump()))
        except (EOFError, OSError, AuthenticationError):
            return


def _flight_recorder_dump() -> str:
    try:
        return _flight_recorder_json()
    except Exception as exc:  # not built in, or not enabled: say so in the dump
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"})


class _Line:
    """The parent's connection to one rank's helper, and the latest answers read from it."""

    def __init__(self, folder: str, rank: int, closed: threading.Event) -> None:
        self.folder, self.rank, self.closed = folder, rank, closed
        self.lock = threading.Lock()
        self.conn: Connection | None = None
        self.connecting = False
        self.pending: list[str] = []  # asked before the connection was up, each once
        self.where: tuple[str, bool] | None = None
        self.dump: str | None = None

    def ask(self, question: str) -> None:
        """Send `question` now, or once connected; connect (off this thread) when not yet."""
        with self.lock:
            if question == _WHERE:
                self.where = None  # the next answer is the one to this question
            if self.conn is None:
                if question not in self.pending:  # (a question asked again has one answer)
                    self.pending.append(question)
                if not self.connecting:
                    self.connecting = True
                    threading.Thread(
                        target=self._connect, name="ddp-verify-asker", daemon=True
                    ).start()
                return
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(question)

    def _connect(self) -> None:
        """Read the rank's address (waiting while the rank has not left it yet), connect, prove
        the key, send what was asked meanwhile, then read answers until the rank hangs up.
        Whatever ends it, the next question connects again (a launcher's restarted worker
        leaves a new address)."""
        conn = None
        try:
            raw = self._address()
            conn = None if raw is None else _connected(raw)
            if conn is None:
                return
            with self.lock:
                self.conn = conn
                for question in self.pending:
                    with contextlib.suppress(OSError, ValueError):
                        conn.send(question)
                self.pending.clear()
            self._read(conn)
        finally:
            with self.lock:
                self.conn, self.connecting = None, False
            if conn is not None:
                conn.close()

    def _address(self) -> bytes | None:
        """The helper's address once the rank has left it; None once the parent is done."""
        while not self.closed.is_set() and os.path.isdir(self.folder):
            with contextlib.suppress(OSError, private.Untrusted):
                raw = private.read(self.folder, f"rank{self.rank}.{ADDRESS}")
                if raw is not None:
                    return raw
            self.closed.wait(0.1)
        return None

    def _read(self, conn: Connection) -> None:
        while not self.closed.is_set():
            try:
                kind, *answer = conn.recv()
            except (EOFError, OSError, ValueError, TypeError):
                return
            with self.lock:
                if kind == _WHERE:
                    self.where = (answer[0], bool(answer[1]))
                elif kind == _FLIGHT_RECORDER:
                    self.dump = str(answer[0])


def _connected(raw: bytes) -> Connection | None:
    """A connection to the helper at address `raw`, both ends having proved the key; None when
    the address is not one or the helper does not prove it."""
    try:
        address = json.loads(raw)
        key = bytes.fromhex(address["key"])
        return Client(("127.0.0.1", int(address["port"])), family="AF_INET", authkey=key)
    except (ValueError, KeyError, TypeError, OSError, EOFError, AuthenticationError):
        return None


class RankHelpers:
    """The parent's end of the ranks' helpers whose addresses are in `folder`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._lines: dict[int, _Line] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # Once nobody holds this end, its threads stop waiting for addresses and answers.
        weakref.finalize(self, self._closed.set)

    def _line(self, rank: int) -> _Line:
        with self._lock:
            if rank not in self._lines:
                self._lines[rank] = _Line(self.folder, rank, self._closed)
            return self._lines[rank]

    def where(self, rank: int, ask_first: bool) -> str | None:
        """The user's line the rank's main thread was at (None: no answer to the latest
        question yet, or no user frame), asking again first when `ask_first`."""
        answer = self._answer(rank, ask_first)
        return answer[0] or None if answer else None

    def in_torch(self, rank: int, ask_first: bool) -> bool | None:
        """Whether the rank's main thread was inside a call into torch that blocks without
        Python frames (`stacks.main_thread_in_torch`); None: no answer yet."""
        answer = self._answer(rank, ask_first)
        return answer[1] if answer else None

    def _answer(self, rank: int, ask_first: bool) -> tuple[str, bool] | None:
        line = self._line(rank)
        if ask_first:
            line.ask(_WHERE)
        with line.lock:
            return line.where

    def flight_recorder(self, ranks: list[int]) -> list[str]:
        """Ask live ranks for their flight recorder's dump and write each that comes within
        `_FR_WAIT_S` to `fr_path(self.folder, rank)`, beside their addresses; the paths
        written."""
        lines = [self._line(r) for r in ranks]
        for line in lines:
            line.ask(_FLIGHT_RECORDER)
        end = time.monotonic() + _FR_WAIT_S
        while time.monotonic() < end and any(line.dump is None for line in lines):
            time.sleep(0.05)
        written = []
        for line in lines:
            with line.lock:
                dump, line.dump = line.dump, None
            path = fr_path(self.folder, line.rank)
            with contextlib.suppress(OSError, private.Untrusted):
                if dump is not None and private.write(
                    self.folder, os.path.basename(path), dump.encode(), asked=True
                ):
                    written.append(path)
        return written


_HELPERS: weakref.WeakValueDictionary[str, RankHelpers] = weakref.WeakValueDictionary()
_HELPERS_LOCK = threading.Lock()


def helpers(folder: str) -> RankHelpers:
    """The one `RankHelpers` of `folder` while anyone holds it (the watchdog and the
    supervisor's flight-recorder request share its connections)."""
    with _HELPERS_LOCK:
        found = _HELPERS.get(folder)
        if found is None:
            found = _HELPERS[folder] = RankHelpers(folder)
        return found


def _flight_recorder_json() -> str:
    import torch
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    dump = flight_recorder_dump(torch._C._distributed_c10d, backend)
    raw = dump(includeCollectives=True, onlyActive=False)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def flight_recorder_dump(c10d, backend: str):
    """The dump function of `backend`'s flight recorder: NCCL keeps its own, which a CUDA
    build has even when the ranks run gloo (a gloo hang's dump from it would be empty); gloo's
    is the generic one."""
    nccl = getattr(c10d, "_dump_nccl_trace_json", None)
    return nccl if nccl is not None and "nccl" in backend else c10d._dump_fr_trace_json
