"""A recording's rows, looked up by (optimizer, step, phase, name): what the comparison and
the alignment read (`departure.py`, `align.py`).

A phase is the audit's label template (`verify/hints/phases.py`, e.g. "gradients
before step {step}") or the loss's (`store.LOSS`); `ORDER` is the order a step's phases are
compared in: the step's inputs (settings, loss, gradients) before what it computes from them
(the parameters after it, the optimizer state), so the first departure named is the cause,
not an echo.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verify.hints.phases import (
    BUFFERS_LOCAL,
    BUFFERS_SYNCED,
    GRADS,
    PARAMS_AFTER,
    PARAMS_FIRST,
    SCALER,
    SETTINGS,
    STATE,
)
from verify.recording.store import LOSS, Recording

ORDER = (SETTINGS, SCALER, BUFFERS_SYNCED, BUFFERS_LOCAL, LOSS, GRADS, PARAMS_AFTER, STATE)


@dataclass(frozen=True)
class Row:
    """One recorded tensor or value."""

    name: str
    dtype: str  # "text" and "float64" for values
    shape: tuple[int, ...]
    hash: int
    numel: int = 0
    blocks: np.ndarray | None = None  # tensors: the sketch
    value: float | None = None  # values: the number (NaN for a text setting)

    @property
    def tensor(self) -> bool:
        return self.blocks is not None


class Table:
    """The rows of one recording, by (optimizer, step, phase) -> {name: Row}, names in the
    order they were recorded."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.rows: dict[tuple[int, int, str], dict[str, Row]] = {}
        t, v = rec.tensors, rec.values
        for i in range(len(t.get("step", ()))):
            name, dtype, shape = rec.keys[int(t["key"][i])]
            row = Row(name, dtype, shape, int(t["hash"][i]), int(t["numel"][i]), t["blocks"][i])
            self._put(int(t["optimizer"][i]), int(t["step"][i]), int(t["phase"][i]), row)
        for i in range(len(v.get("step", ()))):
            name, dtype, shape = rec.keys[int(v["key"][i])]
            row = Row(name, dtype, shape, int(v["hash"][i]), value=float(v["value"][i]))
            self._put(int(v["optimizer"][i]), int(v["step"][i]), int(v["phase"][i]), row)

    def _put(self, opt: int, step: int, phase: int, row: Row) -> None:
        self.rows.setdefault((opt, step, self.rec.phases[phase]), {})[row.name] = row

    def at(self, opt: int, step: int, phase: str) -> dict[str, Row]:
        return self.rows.get((opt, step, phase), {})

    def steps(self, opt: int = 0) -> int:
        counts = self.rec.meta.get("steps") or []
        return int(counts[opt]) if opt < len(counts) else 0

    def start(self, opt: int) -> dict[str, Row]:
        """The parameters before this run's first step (what a resume is aligned by)."""
        return self.at(opt, 0, PARAMS_FIRST)

    def after(self, opt: int, step: int) -> dict[str, Row]:
        return self.at(opt, step, PARAMS_AFTER)

    def dtypes(self) -> set[str]:
        return {r.dtype for r in self.start(0).values()}
