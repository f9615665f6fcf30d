"""Which step of one recording a step of the other corresponds to (docs/compare.md,
"Alignment").

A run resumed from a checkpoint saved after k steps starts from the parameters the full run
held after its step k-1: its step 0 is the full run's step k. So, unless `--align-step K`
says it, the alignment is found from the parameters before each run's first step, bitwise
(the engine's fingerprints): equal to the other's first ones (offset 0), or to the other's
parameters after some step s (offset s + 1, in either direction: the recording or this run
may be the resumed one). Nothing found: offset 0, and the report says the runs start from
different parameters (the comparison then departs there, which is the answer).
"""

from __future__ import annotations

from dataclasses import dataclass

from verify.recording.table import Table


@dataclass(frozen=True)
class Alignment:
    """B's step j is A's step j + offset (offset < 0: A's step j is B's step j - offset)."""

    offset: int
    how: str


def align(a: Table, b: Table, given: int | None = None) -> Alignment:
    """The alignment of `b` (this run) on `a` (the recording): `given` (--align-step), or
    found from the parameters (module docstring). Where several offsets fit equally (the
    parameters did not change from one step to the next), the first is taken and `how` says
    that the alignment is ambiguous, and which offsets fit."""
    if given is not None:
        return Alignment(given, f"by --align-step {given}: this run's step 0 is the "
                                f"recording's step {given}")  # fmt: skip
    fits = _fits(a, b)
    if not fits:
        return Alignment(0, "from step 0 (no step of one run starts from the parameters of "
                            "the other, bitwise: not a resume of it)")  # fmt: skip
    offset = fits[0]
    if offset == 0:
        how = "from step 0: both runs start from the same parameters (bitwise)"
    elif offset > 0:
        how = (f"this run's step 0 is the recording's step {offset}: its parameters before its "
               f"first step equal, bitwise, the recording's after step {offset - 1}")  # fmt: skip
    else:
        how = (f"the recording's step 0 is this run's step {-offset}: its parameters before its "
               f"first step equal, bitwise, this run's after step {-offset - 1}")  # fmt: skip
    if len(fits) > 1:
        shown = ", ".join(map(str, fits[:6])) + (", ..." if len(fits) > 6 else "")
        how += (f"; ambiguous: {len(fits)} offsets fit equally ({shown}), as the parameters "
                "did not change between those steps")  # fmt: skip
    return Alignment(offset, how)


def _fits(a: Table, b: Table) -> list[int]:
    """Every offset the parameters before a run's first step fit, bitwise, in the order
    `align` prefers them: 0, then the recording resumed, then this run."""
    start_a, start_b = _hashes(a.start(0)), _hashes(b.start(0))
    fits = [0] if start_a and start_a == start_b else []
    fits += [s + 1 for s in range(a.steps()) if start_b and _hashes(a.after(0, s)) == start_b]
    fits += [-(s + 1) for s in range(b.steps()) if start_a and _hashes(b.after(0, s)) == start_a]
    return fits


def _hashes(rows) -> list[tuple[str, int]]:
    return [(name, r.hash) for name, r in rows.items()]
