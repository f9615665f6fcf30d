"""`python -m verify compare DIR_A DIR_B`'s options and result: two recordings of `audit
--record`, compared offline with the report of `audit --against` (`departure.py`), and
under `--drill` below it (`drill.py`, which runs the command: its re-runs are audits, which
this module's `with_recording` serves); and what `audit --record/--against` add to the
audit's result (`with_recording`).

Verdicts: "pass" (exit 0) when B agrees with A at every step they share (bitwise, or within
the tolerance, as the report says); "fault" (exit 1) when it departs; "nothing compared"
(exit 2, not a pass) when they share no step. Bad input is one line, exit 2: a folder that
is missing or not a recording, recordings of different models or numbers of optimizers.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from verify import runs
from verify.checks.verdict import FAULT, PASS, Verdicted
from verify.options import OutputOptions, knob
from verify.recording import store
from verify.recording.departure import Comparison, compare_recordings

NOTHING_COMPARED = "nothing audited"  # exit 2 (verdict.EXIT_CODES): no step in common


@dataclass(frozen=True, kw_only=True)
class CompareOptions(OutputOptions):
    """Two recordings (positional), how to align them, and whether to drill below the first
    departing step (`drill.py`; its re-runs' folders go under `--out`)."""

    recordings: tuple[str, ...] = knob((), "DIR_A DIR_B: two folders of audit --record", cli=False)
    align_step: int | None = knob(
        None, "B's step 0 is A's step K (default: found from the parameters, bitwise)",
        minimum=0,
    )  # fmt: skip
    drill: bool = knob(
        False, "re-run both scripts up to the first departing step and name the first op "
        "there whose output differs while its inputs matched (docs/compare.md)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.recordings) != 2:
            raise ValueError("compare needs two recordings: compare DIR_A DIR_B (folders "
                             "written by audit --record)")  # fmt: skip


def verdict_of(c: Comparison) -> str:
    if c.compared_steps == 0:
        return NOTHING_COMPARED
    return FAULT if c.departs else PASS


@dataclass(frozen=True)
class CompareResult(Verdicted):
    """The comparison of B (the second folder) with A (the first)."""

    options: CompareOptions
    comparison: Comparison
    drill: object | None = None  # --drill: the `drill.Drill` found below the departure

    @property
    def verdict(self) -> str:
        return verdict_of(self.comparison)

    def to_dict(self) -> dict:
        return {"check": "compare", "verdict": self.verdict, "passed": self.passed,
                "options": asdict(self.options), "comparison": self.comparison.to_dict(),
                "drill": None if self.drill is None else self.drill.to_dict()}  # fmt: skip


def with_recording(result):
    """The audit's result once the run ended: its recording moved to `--record DIR`, or
    compared with `--against DIR` (raises `NotComparable`, exit 2, for a different model)."""
    o = result.options
    made = os.path.join(result.report_dir, "recording")
    if not os.path.isfile(os.path.join(made, "manifest.json")):
        return RecordedAudit(result, None, None)
    if o.record:
        Path(o.record).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(o.record):  # an empty folder the user made: fill it
            _into(made, o.record)
        else:
            shutil.move(made, o.record)
        return RecordedAudit(result, o.record, None)
    if not o.against:  # --drill alone: the recording stays in the run folder
        return RecordedAudit(result, made, None)
    try:
        ours = store.read(made)
    except store.NotARecording:  # this run's own, cut short: the audit's fault stands
        if result.verdict == PASS:
            raise
        return RecordedAudit(result, None, None)
    comparison = compare_recordings(store.read(o.against), ours, o.align_step)
    out = RecordedAudit(result, made, comparison)
    runs.save_report(result.report_dir, out.to_dict())
    return out


def _into(made: str, folder: str) -> None:
    for name in os.listdir(made):
        shutil.move(os.path.join(made, name), os.path.join(folder, name))


@dataclass(frozen=True)
class RecordedAudit(Verdicted):
    """An audit's result, with where its recording went and, under --against, the
    comparison. Its verdict: the audit's fault or failure first; else the comparison's."""

    audit_result: object
    recording: str | None
    comparison: Comparison | None
    drill: object | None = None  # --drill: the `drill.Drill` found below the divergence

    def __getattr__(self, name):  # the audit's result's fields (options, run, report_dir)
        return getattr(self.__dict__["audit_result"], name)

    @property
    def steps_recorded(self) -> int:
        if self.recording is None:
            return 0
        return store.read(self.recording).steps

    @property
    def verdict(self) -> str:
        own = self.audit_result.verdict
        if own not in (PASS, "nothing audited"):
            return own
        if self.comparison is not None:
            return verdict_of(self.comparison)
        return PASS if self.steps_recorded else NOTHING_COMPARED

    def to_dict(self) -> dict:
        return {**self.audit_result.to_dict(), "verdict": self.verdict, "passed": self.passed,
                "recording": self.recording,
                "comparison": None if self.comparison is None else self.comparison.to_dict(),
                "drill": None if self.drill is None else self.drill.to_dict()}  # fmt: skip
