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

Numbers are little-endian numpy arrays (no pickle: `np.load(allow_pickle=False)`). A row is
about 160 bytes whatever the tensor's size; what is recorded per step is in
docs/compare.md ("What a recording holds"). A folder without a manifest of this format is
not a recording: `read` raises `NotARecording` with one line naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

FORMAT = "ddp-verify recording"
VERSION = 1
LOSS = "loss of step {step}"  # the pseudo-phase of the loss (what backward was called on)


class NotARecording(ValueError):
    """DIR is missing or was not written by `audit --record` (one line, exit 2)."""


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
    """`folder` if it holds a recording of this format, else raise `NotARecording` (one
    line): what `--against` and `compare` check before anything runs."""
    if not os.path.isdir(folder):
        raise NotARecording(f"{folder}: no such folder (expected one written by audit --record)")
    path = os.path.join(folder, "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
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
    return folder


def check_options(options) -> None:
    """`audit`'s --record/--against/--align-step, checked as its options are built: what the
    flags say together (one line, exit 2)."""
    if options.record and options.against:
        raise ValueError("--record and --against cannot be used together (record a run, then "
                         "run again --against its folder)")  # fmt: skip
    if (options.record or options.against) and options.audit_every != 1:
        raise ValueError("--record and --against record every optimizer step: leave "
                         "--audit-every at 1")  # fmt: skip
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
    """The recording in `folder` (raises `NotARecording`, one line, when it is not one)."""
    check(folder)
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    try:
        tensors = dict(np.load(os.path.join(folder, "tensors.npz"), allow_pickle=False))
        values = dict(np.load(os.path.join(folder, "values.npz"), allow_pickle=False))
    except (OSError, ValueError) as exc:
        raise NotARecording(f"{folder} is an incomplete recording ({exc})") from None
    keys = [(n, d, tuple(s)) for n, d, s in manifest.pop("keys")]
    phases, optimizers = manifest.pop("phases"), manifest.pop("optimizers")
    manifest.pop("format"), manifest.pop("version")
    return Recording(manifest, keys, phases, optimizers, tensors, values, folder)
