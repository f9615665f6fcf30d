"""The recorder inside a rank of `audit --record DIR` (and `--against DIR`): at the points the
script audit already audits (`verify/script_audit/hooks.py` calls `add` with the entries it
collected, `collect.py`, named as `naming.py` names them), it keeps per entry one row.

What is kept per optimizer step, and why (docs/compare.md, "What a recording holds"):

- before the step: every param group's settings (exact values); the loss of the step
  (`loss.py`); the gradients and buffers (fingerprint + sketch); at the first step, the
  parameters (what a resumed run is aligned by);
- after the step: the parameters (fingerprint + sketch); the optimizer state at the points
  the audit reads it (the first step and every STATE_EVERY-th): AdamW's moments are twice the
  parameters, and a state that differs shows in the next step's parameters;
- per micro-step of the first optimizer's steps, what the model's forward was given
  (`batch.py`): every rank's inputs, put together as the step's global batch.

Every rank takes part (the sketches are shared out, `shares.py`; every rank fingerprints what
it audits, as the audit does; the loss is averaged over the ranks); an audit point is `add`
before the audit's comparison and `settle` after it, with one all-gather over the audit's own
group, which brings the shares, the losses and the batches to the owner, rank 0. Only it
keeps the rows
and writes the folder, at the end of the script (`finish`, also after a crash).
Sharded tensors are skipped as the audit skips them (`Collector.replicated`): they are not
replicated, and rank 0's shard is not the model's tensor.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from verify.launching.env import LAUNCHED_ENV, RECORD_ENV
from verify.recording import batch, shares, store
from verify.recording.loss import LossTap
from verify.recording.precision import AutocastTap
from verify.recording.sketch import BLOCKS, COLUMNS, sketch, sketched_numel
from verify.replica_audit.fingerprint import text_bits, value_bits

BEFORE = 0  # the audit point before a step (`hooks.py`)


@dataclass
class _Point:
    """One audit point between `Recorder.add` and `Recorder.settle`."""

    index: int
    step: int
    entries: list
    tensors: list  # the entries that hold a tensor
    plan: shares.Plan
    part: shares.Part
    loss: tuple[float, int] | None  # this rank's (loss sum, backward calls), before a step
    # this rank's inputs of the model's forward since the last step, and how many more were
    # dropped (`batch.py`), before a step of the first optimizer
    batch: tuple[list[batch.Input], int] | None = None


def recorder_for(settings) -> Recorder | None:
    """A recorder when the parent asked for one (`RECORD_ENV`), writing beside the rank's
    audit report (`<report folder>/recording`); else None."""
    if not os.environ.get(RECORD_ENV) or not getattr(settings, "path", None):
        return None
    return Recorder(os.path.join(os.path.dirname(settings.path), "recording"))


def _compiled(root) -> bool:
    """`root` is torch.compile's module, or wraps one (DDP or FSDP around a compiled model:
    a wrapper's one child, `module`, as `naming.strip` goes down it)."""
    m = root
    while True:
        if type(m).__name__ == "OptimizedModule":
            return True
        children = list(m._modules.items())
        if len(children) != 1 or children[0][0] not in ("module", "_orig_mod"):
            return False
        m = children[0][1]


class Recorder:
    """Rows of one run (module docstring), written to `folder` by `finish()`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.cwd = os.getcwd()  # where the script started (a script may chdir later)
        self.autocast = AutocastTap()
        self.tap = LossTap(on_backward=self.autocast.seen_at_backward)
        self.batches = batch.BatchTap()
        self.batch_rows: list[tuple] = []
        self.batches_dropped = 0
        self.keys: dict[tuple, int] = {}
        self.phases: dict[str, int] = {}
        self.optimizers: dict[int, str] = {}
        self.optimizer_types: dict[int, str] = {}  # index -> "ZeroRedundancyOptimizer over AdamW"
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
        self._pending: _Point | None = None
        # the owner's time inside `add` and `settle`, in all (the benchmark's figure); of it,
        # this rank's time sketching and its time fingerprinting (the audit's own work, which
        # its comparison reuses), and the elements it sketched
        self.seconds = 0.0
        self.sketch_seconds = 0.0
        self.fingerprint_seconds = 0.0
        self.sketched = 0

    def install(self) -> None:
        self.tap.install()
        self.autocast.install()
        self.batches.install()

    def remove(self) -> None:
        self.tap.remove()
        self.autocast.remove()
        self.batches.remove()

    def add(self, group, roots, index: int, label: str, step: int, point: int, entries) -> None:
        """The first half of one audit point of optimizer `index` (`label`) at `step`, before
        the audit compares it: this rank fingerprints every tensor of `entries` (the audit's
        comparison reuses `e.fingerprint` rather than computing it again) and sketches its
        share of them, as planned for ranks that hold the same entries (`shares.py`); no
        collective. `group` is the audit's side group, `roots` the script's root modules.
        `settle` is the second half."""
        alone = not group.ready()
        self.world_size = 1 if alone else group.size
        self.owner = alone or group.rank == 0
        self.optimizers[index] = label
        loss = seen = None
        if point == BEFORE:
            loss = self.tap.take()
            seen = self.batches.take() if index == 0 else None
            self.compiled = self.compiled or any(_compiled(m) for m in roots)
        start = time.perf_counter()
        try:
            tensors = [e for e in entries if e.tensor is not None]
            size, rank = (1, 0) if alone else (group.size, group.rank)
            plan = shares.planned(tuple(sketched_numel(e.tensor) for e in tensors), size)
            part = shares.Part([e.tensor for e in tensors], plan.shares[rank], plan.capacity)
            for e, fp in zip(tensors, part.fingerprints):
                e.fingerprint = fp
            self.sketch_seconds += part.seconds
            self.fingerprint_seconds += part.fingerprint_seconds
            self.sketched += plan.elements[rank]
            self._pending = _Point(index, step, entries, tensors, plan, part, loss, seen)
        finally:
            self.seconds += time.perf_counter() - start

    def settle(self, group, agreed: bool) -> None:
        """The second half of the audit point `add` began, once the audit's comparison has
        said whether every rank holds the same entries (`agreed`, which every rank knows
        alike; True alone). The ranks are in step then, having just compared, so the one
        collective here waits little: agreed, one all-gather brings every rank's share of
        the sketches to the owner, and at the point before a step each rank's loss with it
        (and, before a step of the first optimizer, its batch: `batch.py`), so the recording
        costs no collective of its own to check the layouts, nor one for the loss or the
        batch. Otherwise (a layout the audit is about to report) the shares were planned for
        different entries: the loss and the batch travel alone and the owner sketches its own
        tensors, alone; a sketch is never filed under another rank's tensor. (A tensor's
        sketch is then of the owner's replica, its fingerprint too: alike when the replicas
        are, which is what the audit checks at the same point.)"""
        p, self._pending = self._pending, None
        if p is None:
            return
        self.steps[p.index] = max(self.steps.get(p.index, 0), p.step + 1)
        if p.loss is not None and p.index == 0:
            self.micro_steps.append(p.loss[1])
        start = time.perf_counter()
        try:
            tables, losses, batches = self._gather(group, agreed, p)
            if not self.owner:
                return
            if p.batch is not None:
                self._batch_rows(p, batches)
            if p.loss is not None and p.loss[1]:
                total = sum(t for t, _ in losses) / len(losses)
                self._value(p.index, p.step, store.LOSS, "loss", total)
            if tables is not None:
                sketches = shares.assemble(p.plan.shares, tables, len(p.tensors))
            else:
                sketches = [sketch(e.tensor) for e in p.tensors]
            self._rows(p, sketches)
        finally:
            self.seconds += time.perf_counter() - start

    def _gather(self, group, agreed: bool, p: _Point) -> tuple[list | None, list, list]:
        """(every rank's sketch table, or None where the shares cannot be put together;
        every rank's (loss sum, backward calls) at the point before a step, else []; every
        rank's packed batch (`batch.pack`) at the point before a step of the first
        optimizer, else [])."""
        mine = [p.loss] if p.loss is not None else []
        words = batch.pack(*p.batch) if p.batch is not None else None
        if not group.ready():
            return [p.part.table], mine, [words] if words is not None else []
        if not agreed:  # every rank gathers, at a point before a step or not (ranks that
            # disagree may be at different points): a rank without a loss sends no calls,
            # one without a batch no inputs, so that every rank sends the same size
            loss = p.loss if p.loss is not None else (float("nan"), 0)
            words = words if words is not None else batch.pack([], 0)
            message = torch.cat([torch.tensor(loss, dtype=torch.float64).view(torch.int64), words])
            rows = group.gather_tensor(message)
            losses = [(float(f[0]), int(f[1])) for f in (r[:2].view(torch.float64) for r in rows)]
            batches = [r[2:] for r in rows] if p.batch is not None else []
            return None, losses, batches  # (losses read only with a loss)
        table, n = p.part.table, len(p.part.table)
        if p.loss is not None:  # the loss's float64 bits ride in two more rows, unchanged,
            bits = torch.tensor(p.loss, dtype=torch.float64).view(torch.float32)
            table = torch.cat([table, bits.view(-1, COLUMNS)])
        if words is not None:  # and the batch's words in one row each
            table = torch.cat([table, words.view(torch.float32).view(-1, COLUMNS)])
        got = group.gather_tensor(table)
        if p.loss is None:
            return got, [], []
        losses = [g[n : n + 2].reshape(-1).view(torch.float64).tolist() for g in got]
        batches = (
            [g[n + 2 :].reshape(-1).view(torch.int64) for g in got] if words is not None else []
        )
        return [g[:n] for g in got], [(t, int(c)) for t, c in losses], batches

    def _batch_rows(self, p: _Point, packed: list) -> None:
        """The owner's rows of the step's global batch (`batch.union` of every rank's)."""
        inputs, dropped = batch.union(p.batch[0], packed)
        self.batches_dropped += dropped
        for x in inputs:
            key = self._key(x.name, x.dtype, x.shape)
            self.batch_rows.append((p.step, x.micro, key, x.samples, x.numel, x.ordered,
                                    x.unordered, x.total, max(x.square, 0.0) ** 0.5))  # fmt: skip

    def _rows(self, p: _Point, sketches) -> None:
        """The owner's rows of audit point `p`: a tensor row per tensor (`sketches` in the
        same order), a value row per setting."""
        for e, blocks in zip(p.tensors, sketches):
            t = e.tensor
            key = self._key(e.name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            row = (p.index, p.step, self._phase(e.phase), key, t.numel(), e.fingerprint)
            self.tensor_rows.append(row)
            self.blocks.append(blocks)
            self.device = t.device.type
        for e in p.entries:
            if e.tensor is None and e.setting is not None:
                self._value(p.index, p.step, e.phase, e.name, e.setting)

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
            "autocast": sorted(self.autocast.dtypes),
            "optimizer_types": [
                self.optimizer_types.get(i, self.optimizers[i]) for i in sorted(self.optimizers)
            ],
            "argv": list(sys.argv),
            "cwd": self.cwd,  # where a drill-down re-runs the script (`checks/drill.py`)
            "launched": bool(os.environ.get(LAUNCHED_ENV)),  # under the user's launcher
            "stopped": self.stopped,
            "batches": {"dropped": self.batches_dropped, "stopped": self.batches.failed},
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
        return store.Recording(meta, keys, phases, optimizers, tensors, values,
                               batches=self._batch_table())  # fmt: skip

    def _batch_table(self) -> dict[str, np.ndarray]:
        """The batch rows as `store.BATCH_COLUMNS`: the sketch's two numbers in float64,
        the step, micro-step and key in int32, the rest in int64."""
        narrow = {"step": np.int32, "micro": np.int32, "key": np.int32, "sum": np.float64,
                  "norm": np.float64}  # fmt: skip
        return {c: np.array([r[i] for r in self.batch_rows], dtype=narrow.get(c, np.int64))
                for i, c in enumerate(store.BATCH_COLUMNS)}  # fmt: skip
