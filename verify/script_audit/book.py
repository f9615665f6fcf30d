"""Folding what each audit point found into distinct findings (the one `Finding`, of check
"audit": `verify/replica_audit/finding.py`), each with its hint.

At one audit point the tensors that differ are grouped by phase. A tensor that already
differed in the same phase at an earlier step adds that step to its finding (`seen_at`):
it is the same divergence, still there. A tensor that newly differs, where an earlier
divergence explains it, makes a finding marked `echo_of` that one:

- parameters after a step: their gradients differed, or they already differed, or an
  optimizer setting or the GradScaler differed at or before this step;
- optimizer state: its parameter's gradients or values differed, or it already did;
- buffers: some parameter of the same optimizer already differed (the forward that updates
  them ran on different weights).

- gradients: the GradScaler's scale already differed (the backward ran on differently
  scaled losses).

Otherwise gradients, and settings, the scale and the first parameters always, are a fault of
their own (gradients are synchronized whatever the weights were).
"""

from __future__ import annotations

from dataclasses import replace

from verify.hints.kinds import AUDIT_LAYOUT, DIVERGENCE, NOTE
from verify.hints.script_audit import script_hint
from verify.replica_audit.compare import Entry, Outcome
from verify.replica_audit.finding import Finding, TensorDiff, diff_numbers
from verify.script_audit import report

MAX_SEEN = 32  # later steps kept per finding


class Book:
    """The findings so far, and which tensors each one covers."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self._covered: dict[tuple[str, str, str], int] = {}  # (optimizer, phase, name) -> i
        self._params: dict[tuple[str, str], int] = {}  # (optimizer, param) -> first finding
        self._grads: dict[tuple[str, str], int] = {}
        self._state: dict[tuple[str, str], int] = {}
        self._whole: dict[str, int] = {}  # optimizer -> first settings / scaler finding
        self._scaled: int | None = None  # the first GradScaler finding (scales every gradient)

    def add(self, optimizer: str, step: int, entries: list[Entry], outcome: Outcome) -> bool:
        """Fold one audit point in; True when the findings changed."""
        if outcome.layout:
            return self._layout(optimizer, step, outcome.layout, outcome.layout_ranks)
        by_phase: dict[str, list[int]] = {}
        for i in outcome.mismatched:
            by_phase.setdefault(entries[i].phase, []).append(i)
        changed = False
        for phase in report.PHASES:
            for i in by_phase.get(phase, ()):
                changed |= self._again(optimizer, step, phase, entries[i].name)
            fresh = [
                i
                for i in by_phase.get(phase, ())
                if not self.known(optimizer, phase, entries[i].name)
            ]
            groups: dict[int | None, list[int]] = {}
            for i in fresh:
                groups.setdefault(self._cause(optimizer, phase, entries[i].name), []).append(i)
            for cause, indices in groups.items():
                self._new(optimizer, step, phase, cause, [entries[i].name for i in indices],
                          [outcome.diffs.get(i) for i in indices])  # fmt: skip
                changed = True
        return changed

    def known(self, optimizer: str, phase: str, name: str) -> bool:
        """This tensor's divergence in this phase is already a finding."""
        return (optimizer, phase, name) in self._covered

    def _again(self, optimizer: str, step: int, phase: str, name: str) -> bool:
        i = self._covered.get((optimizer, phase, name))
        if i is None:
            return False
        f = self.findings[i]
        if step == f.step or step in f.seen_at or len(f.seen_at) >= MAX_SEEN:
            return False
        self.findings[i] = replace(f, steps=(*f.steps, step))
        return True

    def _cause(self, optimizer: str, phase: str, name: str) -> int | None:
        whole = self._whole.get(optimizer)
        if phase == report.PARAMS_AFTER:
            causes = (
                self._grads.get((optimizer, name)),
                self._params.get((optimizer, name)),
                whole,
            )
        elif phase == report.STATE:
            param = name.rsplit(" ", 1)[0]
            causes = (self._grads.get((optimizer, param)), self._params.get((optimizer, param)),
                      self._state.get((optimizer, name)), whole)  # fmt: skip
        elif phase == report.GRADS:
            causes = (self._scaled,)  # different loss scales make different gradients
        elif phase in (report.BUFFERS_SYNCED, report.BUFFERS_LOCAL):
            causes = tuple(i for (o, _), i in self._params.items() if o == optimizer)
        else:
            causes = ()
        cause = min((c for c in causes if c is not None), default=None)
        while cause is not None and self.findings[cause].echo_of is not None:
            cause = self.findings[cause].echo_of  # name the divergence everything follows from
        return cause

    def _new(self, optimizer, step, phase, cause, names, diffs) -> None:
        index = len(self.findings)
        shown = tuple(d if d is not None else TensorDiff(n, (), -1) for n, d in zip(names, diffs))
        kind = NOTE if phase == report.BUFFERS_LOCAL else DIVERGENCE
        ranks = tuple(sorted({r for d in shown for r in d.ranks}))
        numbers = {"optimizer": optimizer, "count": len(names),
                   "tensors": diff_numbers(shown[:8]), "echo_of": cause}  # fmt: skip
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        message = f"{_where(phase, step, optimizer)}: {names[0]}{more} differ{'s' * (not more)}"
        self.findings.append(_hinted(Finding(
            "audit", phase, step, message, names[0], ranks, (step,),
            _where(phase, step, optimizer), kind, numbers,
        )))  # fmt: skip
        for name in names:
            self._covered[(optimizer, phase, name)] = index
            key = (optimizer, name)
            if phase in (report.PARAMS_FIRST, report.PARAMS_AFTER):
                self._params.setdefault(key, index)
            elif phase == report.GRADS:
                self._grads.setdefault(key, index)
            elif phase == report.STATE:
                self._state.setdefault(key, index)
            elif phase in (report.SETTINGS, report.SCALER):
                self._whole.setdefault(optimizer, index)
                if phase == report.SCALER and self._scaled is None:
                    self._scaled = index

    def _layout(self, optimizer: str, step: int, detail: str, ranks: tuple[int, ...]) -> bool:
        key = (optimizer, report.LAYOUT, "")
        if key in self._covered:
            return self._again(optimizer, step, report.LAYOUT, "")
        self._covered[key] = len(self.findings)
        numbers = {"optimizer": optimizer, "count": 0, "tensors": [], "echo_of": None}
        where = _where(report.LAYOUT, step, optimizer)
        found = Finding("audit", report.LAYOUT, step, detail, None, ranks, (step,), where,
                        AUDIT_LAYOUT, numbers)  # fmt: skip
        self.findings.append(_hinted(found))
        return True


def _where(phase: str, step: int, optimizer: str) -> str:
    """The audit point, as a report names it: "gradients before step 2 (SGD)"."""
    return phase.format(step=step) + f" ({optimizer})"


def _hinted(finding: Finding) -> Finding:
    """`finding` with its hint, from the script audit's part of the one hint table."""
    return replace(finding, hint=script_hint(finding))
