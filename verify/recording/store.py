"""A recording on disk: what `audit --record DIR` writes and `--against DIR` and `compare` read.

    DIR/manifest.json   the format and its version, how the run was made (world size,
                        micro-steps per step, torch version, threads, device, torch.compile),
                        the optimizers, the table of tensor and setting keys (name, dtype,
                        shape), the phases
    DIR/tensors.npz     one row per tensor, phase and optimizer step: optimizer, step, phase,
                        key, element count, the engine's fingerprint (bitwise), the sketch
                        (`sketch.py`: 16 blocks x 2 float32)
    DIR/values.npz      one row per setting (param_groups[g].lr, ...), scalar state entry
                        and loss, per step: optimizer, step, phase, key, the value (float64;
                        NaN for a text setting) and its exact bits
    DIR/batches.npz     one row per input of the model's forward, per micro-step of each step
                        of the first optimizer (`batch.py`): step, micro-step, key (name,
                        dtype, a sample's shape), samples, element count, the two numbers of
                        its samples' fingerprints (in order, in any order), sum and norm; the
                        manifest's `batches` says it was recorded (a recording of an earlier
                        version has neither, and compares as before, without its batches)

Numbers are little-endian numpy arrays (no pickle: `np.load(allow_pickle=False)`). A row is
about 160 bytes whatever the tensor's size; what is recorded per step is in
docs/compare.md ("What a recording holds"). A folder without a manifest of this format is
not a recording: `read` raises `NotARecording` with one line naming it.

A recording is checked whole before anything runs (`read`, which `check`, `compare` and
`audit --against` use): the manifest's fields and their types, each file a regular file
(opened without blocking: a FIFO in its place is refused, never waited on) that parses,
every table's columns of one length, every row's optimizer, phase and key an index into the
manifest's lists and its step below its optimizer's count, at least one step. Every way it
can be bad is one `NotARecording` line naming the folder and the file.
"""

from __future__ import annotations

import io
import json
import os
import stat
from dataclasses import dataclass, field

import numpy as np

FORMAT = "ddp-verify recording"
VERSION = 1
LOSS = "loss of step {step}"  # the pseudo-phase of the loss (what backward was called on)


class NotARecording(ValueError):
    """DIR is missing or was not written by `audit --record` (one line, exit 2)."""


# The columns of each table and the kind of number each holds (numpy's dtype kinds).
TENSOR_COLUMNS = {"optimizer": "iu", "step": "iu", "phase": "iu", "key": "iu", "numel": "iu",
                  "hash": "iu", "blocks": "f"}  # fmt: skip
VALUE_COLUMNS = {"optimizer": "iu", "step": "iu", "phase": "iu", "key": "iu", "value": "f",
                 "hash": "iu"}  # fmt: skip
BATCH_COLUMNS = {"step": "iu", "micro": "iu", "key": "iu", "samples": "iu", "numel": "iu",
                 "hash": "iu", "unordered": "iu", "sum": "f", "norm": "f"}  # fmt: skip


@dataclass
class Recording:
    """A recording in memory: the manifest's fields and the two tables of rows."""

    meta: dict
    keys: list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape)
    phases: list[str]
    optimizers: list[str]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    path: str = ""
    batches: dict[str, np.ndarray] | None = None  # None: not recorded (an earlier version)

    @property
    def steps(self) -> int:
        """Optimizer steps recorded (of the first optimizer)."""
        return int(self.meta.get("steps", [0])[0]) if self.meta.get("steps") else 0

    def write(self, folder: str) -> None:
        """Into `folder` (made if missing), the manifest last: a folder whose manifest is
        there holds a whole recording."""
        os.makedirs(folder, exist_ok=True)
        np.savez_compressed(os.path.join(folder, "tensors.npz"), **self.tensors)
        np.savez_compressed(os.path.join(folder, "values.npz"), **self.values)
        if self.batches is not None:
            np.savez_compressed(os.path.join(folder, "batches.npz"), **self.batches)
        manifest = {
            "format": FORMAT, "version": VERSION, **self.meta,
            "optimizers": self.optimizers, "phases": self.phases,
            "keys": [[n, d, list(s)] for n, d, s in self.keys],
        }  # fmt: skip
        tmp = os.path.join(folder, "manifest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(folder, "manifest.json"))


def check(folder: str) -> str:
    """`folder` if it holds a whole recording of this format (`read`), else raise
    `NotARecording` (one line): what `--against` and `compare` check before anything runs."""
    read(folder)
    return folder


def _manifest(folder: str) -> dict:
    """The manifest of `folder`, of this format and version (`NotARecording` otherwise)."""
    if not os.path.isdir(folder):
        raise NotARecording(f"{folder}: no such folder (expected one written by audit --record)")
    try:
        manifest = json.loads(_contents(folder, "manifest.json"))
    except (NotARecording, ValueError):
        raise NotARecording(
            f"{folder} is not a recording: no readable manifest.json (write one with "
            "python -m verify audit --nproc N --record DIR -- train.py)"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise NotARecording(f"{folder} is not a recording: its manifest.json is not "
                            f"{FORMAT!r} (written by audit --record)")  # fmt: skip
    if manifest.get("version") != VERSION:
        raise NotARecording(f"{folder} is a recording of format version "
                            f"{manifest.get('version')}; this tool reads version {VERSION}")  # fmt: skip
    return manifest


def check_options(options) -> None:
    """`audit`'s --record/--against/--align-step, checked as its options are built: what the
    flags say together (one line, exit 2)."""
    if options.record and options.against:
        raise ValueError("--record and --against cannot be used together (record a run, then "
                         "run again --against its folder)")  # fmt: skip
    if (options.record or options.against) and options.audit_every != 1:
        raise ValueError("--record and --against record every optimizer step: leave "
                         "--audit-every at 1")  # fmt: skip
    if options.drill and options.audit_every != 1:
        raise ValueError("--drill records every optimizer step: leave --audit-every at 1")
    if options.align_step is not None and not options.against:
        raise ValueError("--align-step needs --against DIR")


def check_folders(options) -> None:
    """`audit`'s --record/--against folders, checked before the run starts (one line, exit
    2): a recording is never overwritten; --against names a recording of this format."""
    if options.record and os.path.exists(os.path.join(options.record, "manifest.json")):
        raise ValueError(f"{options.record} already holds a recording: choose a new folder "
                         "(a recording is never overwritten)")  # fmt: skip
    if options.against:
        check(options.against)


def read(folder: str) -> Recording:
    """The recording in `folder`, checked whole (module docstring); `NotARecording`, one line
    naming the folder and the file, for any way it is not one."""
    manifest = _manifest(folder)
    _fields(folder, manifest)
    tensors = _table(folder, "tensors.npz", TENSOR_COLUMNS)
    values = _table(folder, "values.npz", VALUE_COLUMNS)
    keys = [(n, d, tuple(s)) for n, d, s in manifest.pop("keys")]
    phases, optimizers = manifest.pop("phases"), manifest.pop("optimizers")
    manifest.pop("format"), manifest.pop("version")
    rec = Recording(manifest, keys, phases, optimizers, tensors, values, folder)
    for name, table in (("tensors.npz", tensors), ("values.npz", values)):
        _rows_in_range(folder, name, table, rec)
    if isinstance(manifest.get("batches"), dict):  # (recorded since the format's batches)
        rec.batches = _table(folder, "batches.npz", BATCH_COLUMNS)
        _rows_in_range(folder, "batches.npz", rec.batches, rec)
    return rec


def _bad(folder: str, name: str, problem: str) -> NotARecording:
    return NotARecording(f"{folder} is not a whole recording: {name} {problem} (record the run "
                         "again with audit --record DIR)")  # fmt: skip


def _contents(folder: str, name: str) -> bytes:
    """The bytes of `folder/name`, a regular file. Opened without blocking and checked
    before it is read: a FIFO or a device in its place would block the read forever."""
    path = os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise _bad(folder, name, f"cannot be opened ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _bad(folder, name, "is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError as exc:
        raise _bad(folder, name, f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def _fields(folder: str, m: dict) -> None:
    """The manifest's fields that the comparison reads, of the types it reads them as."""

    def count(x, least=0):  # an int (not a bool) of at least `least`
        return isinstance(x, int) and not isinstance(x, bool) and x >= least

    def texts(x):
        return isinstance(x, list) and all(isinstance(t, str) for t in x)

    def key(k):
        return (isinstance(k, list) and len(k) == 3 and isinstance(k[0], str)
                and isinstance(k[1], str) and isinstance(k[2], list)
                and all(count(n) for n in k[2]))  # fmt: skip

    wanted = {
        "world_size": (lambda x: count(x, 1), "a number of ranks, 1 or more"),
        "micro_steps": (lambda x: isinstance(x, list) and all(map(count, x)), "a list of counts"),
        "steps": (lambda x: isinstance(x, list) and all(map(count, x)), "a list of step counts"),
        "optimizers": (lambda x: texts(x) and len(x) > 0, "a list of optimizer names"),
        "phases": (texts, "a list of phase names"),
        "keys": (lambda x: isinstance(x, list) and all(map(key, x)),
                 "a list of [name, dtype, shape]"),
        "batches": (lambda x: isinstance(x, dict) and count(x.get("dropped")),
                    "the batches' facts ({'dropped': a count})"),
    }  # fmt: skip
    for name, (ok, what) in wanted.items():
        if name == "batches" and name not in m:
            continue  # a recording of an earlier version: no batches
        if name not in m:
            raise _bad(folder, "manifest.json", f"has no {name!r} ({what})")
        if not ok(m[name]):
            raise _bad(folder, "manifest.json", f"has {name!r} = {_short(m[name])}, not {what}")
    if len(m["steps"]) != len(m["optimizers"]):
        raise _bad(folder, "manifest.json", f"counts steps for {len(m['steps'])} optimizers "
                   f"and names {len(m['optimizers'])}")  # fmt: skip
    if not any(m["steps"]):
        raise NotARecording(f"{folder} holds no optimizer step (manifest.json: the run it "
                            "recorded ended before its first step): nothing to compare")  # fmt: skip


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _table(folder: str, name: str, columns: dict[str, str]) -> dict[str, np.ndarray]:
    """The arrays of `folder/name`, every one read (a truncated member fails here, not in
    the comparison), with `columns` present, of their kinds and of one length."""
    data = _contents(folder, name)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:  # whatever a damaged zip, zlib stream or .npy header raises
        raise _bad(folder, name, f"is not a readable .npz ({type(exc).__name__}: "
                   f"{_short(str(exc))})") from None  # fmt: skip
    rows = None
    for column, kinds in columns.items():
        a = arrays.get(column)
        if a is None:
            raise _bad(folder, name, f"has no column {column!r}")
        if a.dtype.kind not in kinds or a.ndim != (3 if column == "blocks" else 1):
            raise _bad(folder, name, f"has column {column!r} of {a.dtype} {list(a.shape)}")
        rows = len(a) if rows is None else rows
        if len(a) != rows:
            raise _bad(folder, name, f"has columns of different lengths ({column!r}: "
                       f"{len(a)} rows, others {rows})")  # fmt: skip
    return arrays


def _rows_in_range(folder: str, name: str, table: dict, rec: Recording) -> None:
    """Every row's optimizer, phase and key an index into the manifest's lists; its step
    below its optimizer's count of steps (a batch's: the first optimizer's)."""
    bounds = (("optimizer", len(rec.optimizers)), ("phase", len(rec.phases)),
              ("key", len(rec.keys)))  # fmt: skip
    for column, n in bounds:
        if column not in table:  # a batch row is of the first optimizer, and of no phase
            continue
        a = table[column].astype(np.int64)
        outside = (a < 0) | (a >= n)
        if outside.any():
            i = int(np.argmax(outside))
            raise _bad(folder, name, f"row {i} has {column} {a[i]}: the manifest lists "
                       f"{n} (0 to {n - 1})")  # fmt: skip
    optimizer = table.get("optimizer", np.zeros(len(table["step"]), dtype=np.int64))
    steps = np.asarray(rec.meta["steps"], dtype=np.int64)[optimizer.astype(np.int64)]
    step = table["step"].astype(np.int64)
    outside = (step < 0) | (step >= steps)
    if outside.any():
        i = int(np.argmax(outside))
        raise _bad(folder, name, f"row {i} is of step {step[i]}, but the manifest counts "
                   f"{steps[i]} steps of its optimizer")  # fmt: skip
