"""The trace file: the fixed-size binary records a rank's tracer writes and the parent reads.

A trace file is an mmap'ed header plus a ring of `capacity` records, one per collective, and a
sidecar `path + ".strings"` that interns the strings (ops, shapes, call sites, groups) so the
hot path writes numbers only. Why a file and not a pipe: a rank hung inside the backend's C++
cannot answer anything, but the pages it wrote are in the page cache, and the parent sees them
even after the rank was SIGKILLed. The header alone (`read_header`) is what the watchdog polls;
`read_trace` decodes every record for a diagnosis.

    header: magic, version, pid, rank, capacity, records written, events (issues and
            completions, and returns of the calls into torch that issue collectives from C++:
            `untraced.py`), pending (issued, not completed), wall time of the last event
    record: index, per-group sequence number, issue and completion times, element count, and
            interned op, dtype, shape, group, call site; reduce op, peer rank, state, p2p flag
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

from verify import private

MAGIC = b"DDPTRACE"
VERSION = 1
# header: magic, version, pid, rank, capacity, records written, events (issues + completions),
# pending (issued, not completed), wall time of the last event
_HEADER = struct.Struct("<8siqiqqqqd")
_HEADER_SIZE = 64
# record: index, seq, t_issue, t_done, numel, op, dtype, shape, group, site, reduce op, peer,
# state, p2p flag
_RECORD = struct.Struct("<qqddqIIIIIiiBB")
_RECORD_SIZE = 72
_DONE_OFFSET = 24  # where t_done sits in a record (after index, seq, t_issue)
_STATE_OFFSET = _RECORD.size - 2
ISSUED, COMPLETED, FAILED = 1, 2, 3
STATES = {ISSUED: "issued", COMPLETED: "completed", FAILED: "failed"}
DEFAULT_CAPACITY = 8192  # records kept per rank (ring); 72 B each


@dataclass(frozen=True)
class Record:
    """One collective as one rank saw it."""

    index: int  # position in this rank's trace (0, 1, ...)
    seq: int  # per group (collectives) or per (group, peer) (point-to-point), from 1
    op: str
    group: str
    reduce_op: str | None
    dtype: str | None
    numel: int | None
    shape: str | None
    peer: int | None  # src/dst (global rank)
    p2p: bool
    site: str  # file:line (function) of the user's call
    state: str  # "issued" | "completed" | "failed"
    t_issue: float  # wall clock (time.time())
    t_done: float | None
    like: str | None = None  # the parameters of this dtype and shape ("fc1.weight"), if named

    @property
    def pending(self) -> bool:
        return self.state == "issued"

    def signature(self) -> tuple:
        """What must agree across ranks for the same collective."""
        return (self.op, self.dtype, self.numel, self.shape, self.reduce_op, self.peer)

    def describe(self) -> str:
        """`all_reduce #12 on world [float32 (64, 16) SUM]`."""
        parts = [p for p in (self.dtype, self.shape, self.reduce_op) if p]
        if self.peer is not None:
            key = (
                "dst"
                if self.op in ("reduce", "gather", "send", "isend", "gather_object")
                else "src"
            )
            parts.append(f"{key}={self.peer}")
        if self.like:  # what a student recognises: the parameter, not its shape
            parts[-1] += f", shaped like {self.like}"
        inner = f" [{' '.join(parts)}]" if parts else ""
        return f"{self.op} #{self.seq} on {self.group}{inner}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Trace:
    """A rank's trace file as read by the parent."""

    rank: int
    pid: int
    records: tuple[Record, ...]  # the last `capacity` records, oldest first
    events: int
    pending: int
    last_event: float  # wall clock of the last issue or completion (0: none yet)
    dropped: int  # records overwritten by the ring

    def collectives(self, group: str) -> dict[int, Record]:
        return {r.seq: r for r in self.records if r.group == group and not r.p2p}


class Header(NamedTuple):
    """What the watchdog polls: cheap to read, never torn (`Writer._header`)."""

    pid: int
    rank: int
    events: int
    pending: int
    last_event: float  # wall clock of the last issue or completion (0: none yet)


class Writer:
    """Owns the mmap'ed file; every method is called with the GIL held."""

    def __init__(self, path: str, rank: int, capacity: int) -> None:
        self.path, self.capacity = path, capacity
        size = _HEADER_SIZE + capacity * _RECORD_SIZE
        fd = os.open(path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.strings_fd = os.open(path + ".strings", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.ids: dict[str, int] = {}
        self.written = self.events = self.pending = 0
        self.rank, self.pid = rank, os.getpid()
        self._header(0.0)
        os.replace(path + ".tmp", path)  # the parent only ever sees a whole header

    def _header(self, now: float) -> None:
        # Packed apart, then copied in one slice: `pack_into` zero-fills its target before it
        # writes the fields, so a rank killed inside it (gloo aborts from a thread of its own,
        # wherever the main thread is) left a header of zeros: a trace with no records, read
        # as a rank that issued nothing. A copy leaves each field old or new, never zeroed.
        self.map[: _HEADER.size] = _HEADER.pack(
            MAGIC, VERSION, self.pid, self.rank, self.capacity,
            self.written, self.events, self.pending, now,
        )  # fmt: skip

    def intern(self, text: str) -> int:
        sid = self.ids.get(text)
        if sid is None:
            sid = self.ids[text] = len(self.ids) + 1  # 0 means "none"
            os.write(self.strings_fd, f"{sid}\t{text}\n".encode())
        return sid

    def issue(self, fields: tuple) -> int:
        index = self.written
        offset = _HEADER_SIZE + (index % self.capacity) * _RECORD_SIZE
        now = time.time()
        # fields: seq, numel, op, dtype, shape, group, site, reduce op, peer, p2p
        _RECORD.pack_into(self.map, offset, index, fields[0], now, 0.0, *fields[1:-1], ISSUED,
                          fields[-1])  # fmt: skip
        self.written += 1
        self.events += 1
        self.pending += 1
        self._header(now)
        return index

    def progress(self) -> None:
        """An event with no record: a call into torch that issues collectives from C++
        returned (`untraced.py`)."""
        self.events += 1
        self._header(time.time())

    def done(self, index: int, state: int = COMPLETED) -> None:
        if index + self.capacity <= self.written:  # overwritten by the ring already
            self.pending -= 1
            return
        offset = _HEADER_SIZE + (index % self.capacity) * _RECORD_SIZE
        now = time.time()
        struct.pack_into("<d", self.map, offset + _DONE_OFFSET, now)
        self.map[offset + _STATE_OFFSET] = state
        self.events += 1
        self.pending -= 1
        self._header(now)


def read_header(path: str) -> Header | None:
    """The header of a trace file, cheaply; None if it is not there (yet), or if it is not this
    user's alone (`private.py`): the watchdog's polls then see no progress to judge, and the
    verdict's `read_trace` refuses the run."""
    try:
        raw = private.read_path(path, most=_HEADER.size)
    except (OSError, private.Untrusted):
        return None
    if raw is None or len(raw) < _HEADER.size or raw[:8] != MAGIC:
        return None
    _, _, pid, rank, _, _, events, pending, last = _HEADER.unpack(raw)
    return Header(pid, rank, events, pending, last)


def read_trace(path: str, last: int | None = None) -> Trace | None:
    """The whole trace of one rank, or its `last` records (None if it never started tracing).
    A verdict rests on it: `private.Untrusted` for a trace or sidecar not this user's alone."""
    try:
        raw = private.read_path(path)
    except OSError:
        return None
    if raw is None or len(raw) < _HEADER_SIZE or raw[:8] != MAGIC:
        return None
    _, _, pid, rank, capacity, written, events, pending, last_event = _HEADER.unpack_from(raw)
    strings = _read_strings(path + ".strings")
    likes = _read_names(path + ".names")
    records = []
    kept = capacity if last is None else min(last, capacity)
    for index in range(max(0, written - kept), written):
        offset = _HEADER_SIZE + (index % capacity) * _RECORD_SIZE
        (idx, seq, t_issue, t_done, numel, op, dtype, shape, group, site, reduce_op, peer, state,
         p2p) = _RECORD.unpack_from(raw, offset)  # fmt: skip
        if idx != index or state == 0:  # torn write of the very last record
            continue
        records.append(
            Record(
                index=idx, seq=seq, op=strings.get(op, "?"), group=strings.get(group, "?"),
                reduce_op=_reduce_name(reduce_op), dtype=strings.get(dtype),
                numel=None if numel < 0 else numel, shape=strings.get(shape),
                peer=None if peer < 0 else peer, p2p=bool(p2p),
                site=strings.get(site, "<unknown>"), state=STATES.get(state, "?"),
                t_issue=t_issue, t_done=t_done or None,
                like=likes.get((strings.get(dtype), strings.get(shape))),
            )
        )  # fmt: skip
    dropped = max(0, written - capacity)
    return Trace(rank, pid, tuple(records), events, pending, last_event, dropped)


def _read_strings(path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in _lines(path):
        sid, sep, text = line.partition("\t")
        if sep and sid.isdigit():
            out[int(sid)] = text
    return out


def _lines(path: str) -> list[str]:
    """The lines of a sidecar (none: it is not there); Untrusted as `read_trace`."""
    try:
        raw = private.read_path(path)
    except OSError:
        return []
    return [] if raw is None else raw.decode("utf-8", errors="replace").split("\n")


def names_line(dtype: str, shape: str, name: str) -> str:
    """One line of the `.names` sidecar: a named tensor's dtype and shape, as records hold
    them (`tracer.name_shapes` writes it)."""
    return f"{dtype}\t{shape}\t{name}\n"


def _read_names(path: str, most: int = 3) -> dict[tuple[str, str], str]:
    """(dtype, shape) -> "fc1.weight", or "one of fc1.weight, fc2.weight" when several
    parameters share them (a collective is only known by its dtype and shape)."""
    found: dict[tuple[str, str], list[str]] = {}
    for line in _lines(path):
        dtype, shape, name = (line.split("\t") + ["", ""])[:3]
        if name and name not in found.setdefault((dtype, shape), []):
            found[(dtype, shape)].append(name)
    out = {}
    for key, names in found.items():
        shown = ", ".join(names[:most]) + (", ..." if len(names) > most else "")
        out[key] = names[0] if len(names) == 1 else f"one of {shown}"
    return out


def _reduce_name(code: int) -> str | None:
    if code < 0:
        return None
    # torch here, not at the top: the launcher form's parent imports the watchdog before torch
    # (launching/launcher.py); names are read once the ranks have run.
    import torch.distributed as dist

    try:
        return dist.ReduceOp.RedOpType(code).name
    except (ValueError, TypeError):
        return f"op{code}"


def export_jsonl(trace_path: str, jsonl_path: str) -> Trace | None:
    """Write a rank's trace as one JSON record per line (what a report keeps), remove the
    binary files, and return the trace (None if the rank never traced)."""
    trace = read_trace(trace_path)
    if trace is None:
        return None
    with open(jsonl_path, "w") as f:
        for rec in trace.records:
            f.write(json.dumps(rec.to_dict()) + "\n")
    for leftover in (trace_path, trace_path + ".strings", trace_path + ".names"):
        with contextlib.suppress(OSError):
            os.remove(leftover)
    return trace
