"""Whether a script trained anything, per optimizer: a `Stillness` (the engine's,
`verify/replica_audit/stillness.py`) for each, fed the gradients and the parameters' fingerprints
of every audit point the ranks agreed on the layout of, which the audit holds already (no
collective of its own). The report says which optimizers' gradients were exactly zero at every
audited step, and which never changed a parameter (`AuditReport.zero_gradients`, `unchanged`).
"""

from __future__ import annotations

from verify.replica_audit.compare import Entry, Outcome
from verify.replica_audit.stillness import Stillness
from verify.script_audit import report

_PARAMS = (report.PARAMS_FIRST, report.PARAMS_AFTER)


class Motion:
    """The optimizers' `Stillness`, by label (module docstring)."""

    def __init__(self) -> None:
        self.by_label: dict[str, Stillness] = {}

    def saw(self, label: str, entries: list[Entry], outcome: Outcome) -> None:
        """One audit point of optimizer `label`, as compared (`outcome`)."""
        if not outcome.prints:  # the ranks audit different entries, or one rank records alone
            return
        still = self.by_label.setdefault(label, Stillness())
        grads = [e.tensor for e in entries if e.phase == report.GRADS]
        if grads:
            still.gradients(grads)
        params = {e.name: p for e, p in zip(entries, outcome.prints) if e.phase in _PARAMS}
        if params:
            still.parameters(params)

    def zero_gradients(self) -> tuple[str, ...]:
        return tuple(label for label, s in self.by_label.items() if s.zero_gradients)

    def unchanged(self) -> tuple[str, ...]:
        return tuple(label for label, s in self.by_label.items() if s.unchanged)
