"""Two recordings, step by step: where does the second run (B, "this run") first depart from
the first (A, "the recording"), and what follows (docs/compare.md).

1. Same model and optimizers, or nothing to compare (`NotComparable`, a usage error: exit 2): as
   many optimizers, and for each the same parameters, in order, by name and shape (the first
   that differs is named). A dtype may differ (float32 against bfloat16): it is compared
   within the coarser dtype's tolerance.
2. The alignment (`align.py`) and the mode (`tolerance.py`: bitwise, or within eps).
3. Whether the runs were given the same batches (`batch_departure.py`), said before the
   first departure.
4. Step by step over the steps both runs took, each optimizer in turn, each step's phases in
   `table.ORDER` (its inputs before what it computes from them), and at the first compared
   step the parameters before it: every entry of A against B's of the same name. A departure
   is a value that differs (bitwise mode) or is beyond eps (tolerance mode), or an entry one
   run has and the other lacks (a gradient that is None in one run only). The optimizer
   state is compared at the steps both recorded it.

The first departure is described in full (`Departure`: step in both numberings, phase,
tensor or setting, the two values or by how much and in which block, and its kind and
numbers, from which its hint is chosen: `hints/table.py`); the ones after it are counted,
step by step, as what follows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from verify.hints import kinds as k
from verify.hints import table as hints
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
from verify.recording import tolerance
from verify.recording.align import Alignment, align
from verify.recording.batch_departure import Batches, compare_batches
from verify.recording.sketch import BLOCKS, block_size, gaps, totals
from verify.recording.store import LOSS, Recording
from verify.recording.table import ORDER, Row, Table

# a departure's kind (its hint's key, `hints/table.py`), by the phase it is in
KINDS = {
    PARAMS_FIRST: k.START_DEPARTS, SETTINGS: k.SETTING_DEPARTS, SCALER: k.SCALER_DEPARTS,
    BUFFERS_SYNCED: k.BUFFERS_DEPART, BUFFERS_LOCAL: k.BUFFERS_DEPART, LOSS: k.LOSS_DEPARTS,
    GRADS: k.GRADIENTS_DEPART, PARAMS_AFTER: k.PARAMETERS_DEPART, STATE: k.STATE_DEPARTS,
}  # fmt: skip


class NotComparable(ValueError):
    """The two recordings are not of the same model or optimizers (one line, exit 2)."""


@dataclass(frozen=True)
class Departure:
    """One entry where B departs from A."""

    step: int  # A's step (the recording's numbering)
    step_b: int  # B's
    phase: str  # the phase with its step filled in (A's numbering)
    optimizer: str
    name: str  # the tensor, the setting (param_groups[0].lr) or "loss"
    what: str  # by how much, and where
    gap: float | None = None  # tolerance mode: the largest relative gap; None: not measured
    block: int | None = None
    kind: str = ""  # `KINDS`: what departed, the hint's key
    # what was measured: the compared step's index and the alignment's offset; the loss's
    # two values and each run's micro-steps; a setting's key
    numbers: dict = field(default_factory=dict)
    hint: str | None = None  # the first departure's (`hints/table.py`)


@dataclass(frozen=True)
class Comparison:
    """What `compare` and `audit --against` report."""

    bitwise: bool
    mode_reason: str
    alignment: str
    offset: int
    steps_a: tuple[int, int]  # [first, last] of A's compared steps (empty: first > last)
    steps_b: tuple[int, int]
    first: Departure | None = None
    following: tuple[tuple[int, str, int, tuple[str, ...]], ...] = ()  # (step, phase, n, names)
    departing_steps: int = 0
    compared_steps: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    # tolerance mode: the agreeing entry closest to its tolerance (gap / eps, gap, eps, what)
    closest: tuple[float, float, float, str] | None = None
    # were the runs given the same batches (`batch_departure.py`)? None: a recording
    # without batches (of an earlier version)
    batches: Batches | None = None

    @property
    def departs(self) -> bool:
        return self.first is not None

    def to_dict(self) -> dict:
        return asdict(self)


def compare_recordings(a: Recording, b: Recording, align_step: int | None = None) -> Comparison:
    """Compare B with A (module docstring); raises `NotComparable` when they are of different
    models or optimizers."""
    ta, tb = Table(a), Table(b)
    _same_model(ta, tb)
    al = align(ta, tb, align_step)
    lo_b = max(0, -al.offset)
    hi_b = min(tb.steps(), ta.steps() - al.offset)
    steps_b = range(lo_b, max(lo_b, hi_b))
    steps_a = range(lo_b + al.offset, lo_b + al.offset + len(steps_b))
    mode = tolerance.mode(a.meta, b.meta, steps_a, steps_b)
    prec = tolerance.precision(a.meta, b.meta)
    loss_dtype = prec.of(tolerance.coarsest(ta.dtypes() | tb.dtypes()))
    reason = mode.reason if mode.bitwise or prec.autocast is None else (
        f"{mode.reason}; {prec.reason}")  # fmt: skip
    notes = _notes(ta, tb, steps_a, steps_b, al)
    found: list[Departure] = []
    following: list[tuple[int, str, int, tuple[str, ...]]] = []
    departing = 0
    closest: list = []  # the agreeing entry nearest its tolerance (`_judge` appends)
    for j, (sa, sb) in enumerate(zip(steps_a, steps_b)):
        here: list[Departure] = []
        for opt, label in enumerate(a.optimizers):
            for phase, rows_a, rows_b in _phases(ta, tb, opt, sa, sb, al, first=j == 0):
                for name in _names(rows_a, rows_b):
                    ra, rb = rows_a.get(name), rows_b.get(name)
                    d = _judge(ra, rb, mode.bitwise, j, loss_dtype, prec)
                    if d is not None and d[0] is None:  # agrees: (None, gap, eps)
                        _keep_closest(closest, d[1], d[2], f"{name}, {phase.format(step=sa)}")
                    elif d is not None:
                        what, gap, block = d
                        numbers = _numbers(a, b, phase, ra, rb, j, al.offset, sa, sb)
                        here.append(Departure(sa, sb, phase.format(step=sa), label, name,
                                              what, gap, block, KINDS.get(phase, ""),
                                              numbers))  # fmt: skip
        if here:
            departing += 1
            if not found:
                found = here
            if departing <= 4:  # the first departing step in full, the next three in short
                following += _grouped(here[1:] if here is found else here)
    first = None
    if found:  # its hint, from its kind and numbers (the run's world size: this run's)
        first = found[0]
        first = replace(first, hint=hints.hint_for(first, hints.Situation(b.meta["world_size"])))
    return Comparison(
        bitwise=mode.bitwise, mode_reason=reason, alignment=al.how, offset=al.offset,
        steps_a=(steps_a.start, steps_a.stop - 1), steps_b=(steps_b.start, steps_b.stop - 1),
        first=first, following=tuple(following),
        departing_steps=departing, compared_steps=len(steps_b), notes=tuple(notes),
        closest=closest[0] if closest else None,
        batches=compare_batches(a, b, steps_a, steps_b),
    )  # fmt: skip


def _keep_closest(closest: list, gap: float, limit: float, what: str) -> None:
    if limit > 0 and (not closest or gap / limit > closest[0][0]):
        closest[:] = [(gap / limit, gap, limit, what)]


def _same_model(a: Table, b: Table) -> None:
    na, nb = len(a.rec.optimizers), len(b.rec.optimizers)
    if na != nb:
        raise NotComparable(
            f"the runs have different numbers of optimizers: {na} in the recording "
            f"({', '.join(a.rec.optimizers)}), {nb} in this run ({', '.join(b.rec.optimizers)})"
        )
    for opt in range(na):
        pa, pb = list(a.start(opt).values()), list(b.start(opt).values())
        for i in range(max(len(pa), len(pb))):
            ra = pa[i] if i < len(pa) else None
            rb = pb[i] if i < len(pb) else None
            if ra is None or rb is None or (ra.name, ra.shape) != (rb.name, rb.shape):
                raise NotComparable(
                    f"the runs train different models: {a.rec.optimizers[opt]}'s parameter "
                    f"{i} is {_param(ra)} in the recording, {_param(rb)} in this run"
                )


def _param(r: Row | None) -> str:
    return "absent" if r is None else f"{r.name} {list(r.shape)}"


def _phases(a: Table, b: Table, opt: int, sa: int, sb: int, al: Alignment, first: bool):
    """(phase, A's rows, B's rows) of one compared step, in order."""
    if first:  # the parameters the compared steps start from
        start_a = a.start(opt) if sa == 0 else a.after(opt, sa - 1)
        start_b = b.start(opt) if sb == 0 else b.after(opt, sb - 1)
        yield PARAMS_FIRST, start_a, start_b
    for phase in ORDER:
        rows_a, rows_b = a.at(opt, sa, phase), b.at(opt, sb, phase)
        if phase in (STATE, LOSS) and not (rows_a and rows_b):
            continue  # recorded at some steps only (the state), or no loss seen
        yield phase, rows_a, rows_b


def _names(rows_a: dict, rows_b: dict) -> list[str]:
    return list(rows_a) + [n for n in rows_b if n not in rows_a]


def _numbers(
    a: Recording, b: Recording, phase: str, ra, rb, j: int, offset: int, sa: int, sb: int
) -> dict:
    """What a departure's hint reads (`Departure.numbers`)."""
    numbers = {"compared_step": j, "offset": offset, "in_one_run": ra is None or rb is None}
    if phase == LOSS and ra is not None and rb is not None:
        numbers |= {"recording": ra.value, "this_run": rb.value,
                    "micro_steps_recording": _at(a.meta.get("micro_steps"), sa),
                    "micro_steps": _at(b.meta.get("micro_steps"), sb)}  # fmt: skip
    if phase == SETTINGS:  # "param_groups[1].lr" or "param_groups[0].betas[0]"
        key = (ra or rb).name.split(".", 1)[-1]
        numbers["setting"] = key.split("[", 1)[0]
    return numbers


def _at(values, i: int):
    return values[i] if values and 0 <= i < len(values) else None


def _judge(
    ra: Row | None,
    rb: Row | None,
    bitwise: bool,
    j: int,
    loss_dtype: str,
    prec: tolerance.Precision,
):
    """None when B's entry agrees with A's (in tolerance mode, (None, gap, eps)); else
    (what, gap, block)."""
    if ra is None or rb is None:
        return (f"{'absent' if ra is None else 'present'} in the recording, "
                f"{'absent' if rb is None else 'present'} in this run", None, None)  # fmt: skip
    if ra.tensor != rb.tensor or ra.shape != rb.shape:
        return f"{_kind(ra)} in the recording, {_kind(rb)} in this run", None, None
    if ra.hash == rb.hash:
        return None
    if not ra.tensor:
        return _judge_value(ra, rb, bitwise, j, loss_dtype)
    g = gaps(ra.blocks, rb.blocks, ra.numel)
    block = int(np.argmax(g))
    where = _block_text(block, ra)
    na, nb = totals(ra.blocks)[1], totals(rb.blocks)[1]
    if bitwise:
        if g[block] == 0:
            return (f"differs bitwise (norm {na:.7g} in both, to float32 precision: a "
                    f"difference below 1e-7 relative)", 0.0, None)  # fmt: skip
        return (f"differs bitwise: norm {na:.7g} vs {nb:.7g}, relative difference at least "
                f"{g[block]:.2g}, largest in {where}", float(g[block]), block)  # fmt: skip
    dtype = ra.dtype if ra.dtype == rb.dtype else tolerance.coarsest({ra.dtype, rb.dtype})
    limit = tolerance.eps(prec.of(dtype), j)
    if g[block] <= limit and limit > 0:
        return None, float(g[block]), limit
    return (f"norm {na:.7g} vs {nb:.7g}: relative difference at least {g[block]:.2g} "
            f"(tolerance {limit:.2g}), largest in {where}", float(g[block]), block)  # fmt: skip


def _judge_value(ra: Row, rb: Row, bitwise: bool, j: int, loss_dtype: str):
    va, vb = ra.value, rb.value
    if ra.dtype == "text" or rb.dtype == "text":
        return "a different value (text)", None, None
    shown = f"{va:.10g} in the recording, {vb:.10g} in this run"
    if bitwise or ra.name != "loss":  # settings are exact in both modes
        return shown, None, None
    scale = max(abs(va), abs(vb))
    gap = abs(va - vb) / scale if scale > 0 else 0.0
    limit = tolerance.eps(loss_dtype, j)
    if np.isnan(va) and np.isnan(vb):
        return None
    if gap <= limit:
        return None, gap, limit
    return f"{shown}: relative difference {gap:.2g} (tolerance {limit:.2g})", gap, None


def _kind(r: Row) -> str:
    return f"a tensor {list(r.shape)}" if r.tensor else "a value"


def _block_text(block: int, r: Row) -> str:
    """Block `block` of tensor `r` as a user reads it: its elements and, for a tensor of two
    or more dimensions, the rows of its first dimension."""
    size = block_size(r.numel)
    lo, hi = block * size, min((block + 1) * size, r.numel) - 1
    used = min(BLOCKS, -(-r.numel // size))
    text = f"block {block + 1} of {used} (elements {lo}..{hi} of {r.numel}"
    if len(r.shape) >= 2 and r.shape[0]:
        per_row = r.numel // r.shape[0]
        text += f", rows {lo // per_row}..{hi // per_row} of dimension 0"
    return text + ")"


def _grouped(deps: list[Departure]) -> list[tuple[int, str, int, tuple[str, ...]]]:
    out: dict[tuple[int, str], list[str]] = {}
    for d in deps:
        out.setdefault((d.step, d.phase), []).append(d.name)
    return [(s, p, len(names), tuple(names[:4])) for (s, p), names in out.items()]


def _notes(a: Table, b: Table, steps_a: range, steps_b: range, al: Alignment) -> list[str]:
    notes = []
    if a.steps() != b.steps() or al.offset:
        notes.append(f"the recording has {a.steps()} steps, this run {b.steps()}: compared "
                     f"the {len(steps_b)} they share")  # fmt: skip
    kinds_a, kinds_b = a.rec.meta.get("optimizer_types"), b.rec.meta.get("optimizer_types")
    if kinds_a and kinds_b and kinds_a != kinds_b:  # (kept by recordings of this tool)
        notes.append(f"the optimizers differ: {', '.join(kinds_a)} in the recording, "
                     f"{', '.join(kinds_b)} in this run")  # fmt: skip
    for which, t in (("the recording", a), ("this run", b)):
        if t.rec.meta.get("stopped"):
            notes.append(f"{which} stopped recording early: {t.rec.meta['stopped']}")
    if steps_a and not any(a.after(0, s) for s in steps_a):
        notes.append("no parameters recorded after a compared step")
    return notes
