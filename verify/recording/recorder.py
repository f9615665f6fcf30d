"""The recorder inside a rank of `audit --record DIR` (and `--against DIR`): at the points the
script audit already audits (`verify/script_audit/auditor.py` calls `add` with the entries it
collected, `collect.py`, named as `naming.py` names them), it keeps per entry one row.

What is kept per optimizer step, and why (docs/compare.md, "What a recording holds"):

- before the step: every param group's settings (exact values); the loss of the step
  (`loss.py`); the gradients and buffers (fingerprint + sketch); at the first step, the
  parameters (what a resumed run is aligned by);
- after the step: the parameters (fingerprint + sketch); the optimizer state at the points
  the audit reads it (the first step and every STATE_EVERY-th): AdamW's moments are twice the
  parameters, and a state that differs shows in the next step's parameters.

Every rank takes part (the loss is averaged over the ranks, one all-gather of two numbers at
the step, over the audit's own group; the sketches are shared out, `shares.py`; every rank
fingerprints what it audits, as the audit does); only the owner, rank 0, keeps the rows and
writes the folder, at the end of the script (`finish`, also after a crash).
Sharded tensors are skipped as the audit skips them (`Collector.replicated`): they are not
replicated, and rank 0's shard is not the model's tensor.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from verify.launching.env import RECORD_ENV
from verify.recording import shares, store
from verify.recording.loss import LossTap
from verify.recording.sketch import BLOCKS, COLUMNS, sketched_numel
from verify.replica_audit.fingerprint import text_bits, value_bits

BEFORE = 0  # the audit point before a step (`auditor.py`)


def recorder_for(settings) -> Recorder | None:
    """A recorder when the parent asked for one (`RECORD_ENV`), writing beside the rank's
    audit report (`<report folder>/recording`); else None."""
    if not os.environ.get(RECORD_ENV) or not getattr(settings, "path", None):
        return None
    return Recorder(os.path.join(os.path.dirname(settings.path), "recording"))


class Recorder:
    """Rows of one run (module docstring), written to `folder` by `finish()`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.tap = LossTap()
        self.keys: dict[tuple, int] = {}
        self.phases: dict[str, int] = {}
        self.optimizers: dict[int, str] = {}
        self.steps: dict[int, int] = {}
        self.tensor_rows: list[tuple] = []
        self.blocks: list[np.ndarray] = []
        self.value_rows: list[tuple] = []
        self.micro_steps: list[int] = []
        self.world_size = 1
        self.owner = True
        self.compiled = False
        self.device = "cpu"
        self.stopped: str | None = None
        # the owner's time fingerprinting and sketching, in all (the benchmark's figure; the
        # loss's all-gather is left out: its wait is the slower rank's, which the audit's own
        # agreement would wait for anyway); of it, this rank's time sketching and its time
        # fingerprinting (the audit's own work, which its comparison reuses), and the
        # elements it sketched
        self.seconds = 0.0
        self.sketch_seconds = 0.0
        self.fingerprint_seconds = 0.0
        self.sketched = 0

    def install(self) -> None:
        self.tap.install()

    def remove(self) -> None:
        self.tap.remove()

    def add(self, group, roots, index: int, label: str, step: int, point: int, entries) -> None:
        """The entries of one audit point of optimizer `index` (`label`) at `step`; `group` is
        the audit's side group, `roots` the script's root modules. Called on every rank in
        the same order (the loss's all-gather is a collective)."""
        alone = not group.ready()
        self.world_size = 1 if alone else group.size
        self.owner = alone or group.rank == 0
        self.optimizers[index] = label
        self.steps[index] = max(self.steps.get(index, 0), step + 1)
        if point == BEFORE:
            self._loss(group, alone, index, step)
            self.compiled = self.compiled or any(
                type(m).__name__ == "OptimizedModule" for m in roots
            )
        start = time.perf_counter()
        try:
            sketches = self._measure(group, alone, [e for e in entries if e.tensor is not None])
            if self.owner:
                self._rows(index, step, entries, sketches)
        finally:
            self.seconds += time.perf_counter() - start

    def _measure(self, group, alone: bool, tensors: list) -> np.ndarray | None:
        """Fingerprint and sketch `tensors` (entries); the sketches on the owner (None
        elsewhere). Every rank fingerprints all of them, as the audit's comparison would
        (it reuses `e.fingerprint`), and the ranks share the sketching when they hold the
        same entries (one all-reduce of their count and a digest of their keys says so):
        `shares.py` plans each rank's share, balanced by elements (and a tensor's fixed
        cost), each rank sketches its share as it fingerprints, and one all-gather brings
        the rows to the owner (the step waits for the slowest rank). Otherwise (a layout the
        audit is about to report) the owner fingerprints and sketches its own, alone, and
        the others leave theirs to the comparison: a sketch is never filed under another
        rank's tensor. (A tensor's sketch is then, block by block, of one rank's replica or
        another's, its fingerprint of the owner's: alike when the replicas are, which is
        what the audit checks at the same point.)"""
        size, rank = 1, 0
        if not alone:
            digest = text_bits("\n".join(e.key for e in tensors))
            n = len(tensors)
            most, fewest, dmax, dmin = group.max([n, -n, digest, ~digest])
            if most == -fewest and dmax == ~dmin:
                size, rank = group.size, group.rank
            elif not self.owner:
                return None
        plan = shares.planned(tuple(sketched_numel(e.tensor) for e in tensors), size)
        part = shares.Part([e.tensor for e in tensors], plan.shares[rank], plan.capacity)
        for e, fp in zip(tensors, part.fingerprints):
            e.fingerprint = fp  # the audit's comparison, next, uses it rather than recompute
        self.sketch_seconds += part.seconds
        self.fingerprint_seconds += part.fingerprint_seconds
        self.sketched += plan.elements[rank]
        tables = group.gather_tensor(part.table) if size > 1 else [part.table]
        return shares.assemble(plan.shares, tables, len(tensors)) if self.owner else None

    def _rows(self, index: int, step: int, entries, sketches: np.ndarray) -> None:
        tensors = [e for e in entries if e.tensor is not None]
        for e, blocks in zip(tensors, sketches):
            t = e.tensor
            key = self._key(e.name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            row = (index, step, self._phase(e.phase), key, t.numel(), e.fingerprint)
            self.tensor_rows.append(row)
            self.blocks.append(blocks)
            self.device = t.device.type
        for e in entries:
            if e.tensor is None and e.setting is not None:
                self._value(index, step, e.phase, e.name, e.setting)

    def _loss(self, group, alone: bool, index: int, step: int) -> None:
        total, calls = self.tap.take()
        if not alone:  # every rank's (sum, calls): one all-gather of two numbers
            rows = group.gather_tensor(torch.tensor([total, float(calls)], dtype=torch.float64))
            sums = [float(r[0]) for r in rows]
            total = sum(sums) / len(sums)
        if calls and self.owner:
            self._value(index, step, store.LOSS, "loss", total)
        if index == 0:
            self.micro_steps.append(calls)

    def _value(self, index: int, step: int, phase: str, name: str, value) -> None:
        text = isinstance(value, str)
        key = self._key(name, "text" if text else "float64", ())
        number = float("nan") if text else float(value)
        bits = text_bits(value) if text else value_bits(value)
        self.value_rows.append((index, step, self._phase(phase), key, number, bits))

    def _key(self, name: str, dtype: str, shape: tuple) -> int:
        return self.keys.setdefault((name, dtype, shape), len(self.keys))

    def _phase(self, phase: str) -> int:
        return self.phases.setdefault(phase, len(self.phases))

    def finish(self) -> None:
        """Write the folder (the owner only); called once the script ended or crashed."""
        if not self.owner or not self.optimizers:
            return
        self.recording().write(self.folder)

    def recording(self) -> store.Recording:
        t = np.array(self.tensor_rows, dtype=np.int64).reshape(-1, 6)
        v = self.value_rows
        meta = {
            "world_size": self.world_size,
            "micro_steps": self.micro_steps,
            "steps": [self.steps[i] for i in sorted(self.steps)],
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": self.device,
            "compiled": self.compiled,
            "argv": list(sys.argv),
            "stopped": self.stopped,
        }
        tensors = {
            "optimizer": t[:, 0].astype(np.int16), "step": t[:, 1].astype(np.int32),
            "phase": t[:, 2].astype(np.int16), "key": t[:, 3].astype(np.int32),
            "numel": t[:, 4], "hash": t[:, 5],
            "blocks": np.stack(self.blocks) if self.blocks else np.zeros((0, BLOCKS, COLUMNS), np.float32),
        }  # fmt: skip
        values = {
            "optimizer": np.array([r[0] for r in v], dtype=np.int16),
            "step": np.array([r[1] for r in v], dtype=np.int32),
            "phase": np.array([r[2] for r in v], dtype=np.int16),
            "key": np.array([r[3] for r in v], dtype=np.int32),
            "value": np.array([r[4] for r in v], dtype=np.float64),
            "hash": np.array([r[5] for r in v], dtype=np.int64),
        }
        keys = sorted(self.keys, key=self.keys.get)
        phases = sorted(self.phases, key=self.phases.get)
        optimizers = [self.optimizers[i] for i in sorted(self.optimizers)]
        return store.Recording(meta, keys, phases, optimizers, tensors, values)
