"""What the audit found, as typed records that travel from a rank to the parent (JSON).

A `Finding` is one distinct divergence: at one audit point (an optimizer's step, before or
after it) and one phase, the tensors that newly differ across ranks, each with the ranks that
differ and by how much (`TensorDiff`), and what this usually means. A later step where the
same tensors differ again adds to the finding's `seen_at` rather than making a new one, and a
divergence that follows from an earlier one (parameters after a step whose gradients already
differed) records which (`echo_of`). Kinds: "divergence" and "layout" (the ranks audit
different sets of tensors, or are at different steps) are faults; "note" is not (buffers
that the script's wrapper does not synchronize and that differ: a documented design).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

# The phases (what a finding compared), where the hint table reads them too.
from verify.script_audit.phases import (  # noqa: E402, F401
    BUFFERS_LOCAL,
    BUFFERS_SYNCED,
    GRADS,
    LAYOUT,
    PARAMS_AFTER,
    PARAMS_FIRST,
    PHASES,
    SCALER,
    SETTINGS,
    STATE,
)  # fmt: skip


@dataclass(frozen=True)
class TensorDiff:
    """One tensor that is not bitwise identical on every rank."""

    name: str
    ranks: tuple[int, ...]  # ranks whose value differs from the reference rank's
    reference_rank: int  # the rank holding the value most ranks hold (the lowest on a tie)
    max_abs_diff: float | None = None  # largest |difference| on any rank, vs the reference
    differing: int | None = None  # elements that differ, on the worst rank
    numel: int | None = None
    first_index: tuple[int, ...] | None = None  # first differing element, on the worst rank
    values: tuple[str, ...] = ()  # a setting's value on each rank ("rank 0: 0.001")
    scale: float | None = None  # the differing ranks' values are scale x the reference's

    def describe(self) -> str:
        if not self.ranks:  # not described: beyond the detail gathered at its audit point
            return self.name
        s = "s" if len(self.ranks) > 1 else ""
        head = f"{self.name} on rank{s} {_ranks(self.ranks)} vs rank {self.reference_rank}"
        if self.values:
            return f"{head}: {', '.join(self.values)}"
        if self.differing is None:
            return head
        where = "" if self.first_index is None else f", first at {list(self.first_index)}"
        return (f"{head}: max |diff| {self.max_abs_diff:.3g}, {self.differing}/{self.numel} "
                f"elements differ{where}")  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One distinct divergence (module docstring)."""

    kind: str  # "divergence" | "layout" | "note"
    optimizer: str  # the optimizer's class, numbered when the script has several
    step: int  # the script's optimizer step (0 = the first step() call)
    phase: str  # one of PHASES
    tensors: tuple[TensorDiff, ...]  # the first few, with detail
    count: int  # tensors that differ (more than `tensors` holds when many do)
    detail: str = ""  # for "layout": what differs between the ranks
    echo_of: int | None = None  # index of the earlier finding this one follows from
    seen_at: tuple[int, ...] = ()  # later steps where the same tensors differed again

    @property
    def where(self) -> str:
        return self.phase.format(step=self.step) + f" ({self.optimizer})"

    @property
    def hint(self) -> str:
        """What it usually means: chosen by its phase and numbers (`checks/script_hints.py`)."""
        from verify.checks.script_hints import script_hint

        return script_hint(self)

    @property
    def fault(self) -> bool:
        return self.kind != "note"


@dataclass(frozen=True)
class AuditReport:
    """What one rank's audit saw; every rank reaches the same findings (they are decided by
    reductions over all ranks), so the parent may read any rank's."""

    every: int = 1
    steps: dict[str, int] = field(default_factory=dict)  # optimizer -> steps the script took
    audits: int = 0  # audit points (before a step, after it, its state) checked
    audited_steps: int = 0  # optimizer steps audited (before and after)
    tensors: int = 0  # the most tensors checked at one audit point
    sharded: int = 0  # sharded tensors seen and never compared (ZeRO, FSDP2), at most at once
    # optimizer -> its state entries held by one rank each by design (an owner-rank optimizer
    # such as Muon, ZeRO's local optimizer, FSDP2's shards), never compared across ranks
    sharded_state: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # time this rank spent inside the audit, in all
    findings: tuple[Finding, ...] = ()
    stopped: str | None = None  # why auditing stopped before the script ended
    finished: bool = False  # the script ended (or exited) and the report was written then

    @property
    def faults(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.fault)

    def to_dict(self) -> dict:
        """As JSON; each finding also says where it is and what it usually means, in words."""
        d = asdict(self)
        for f, fd in zip(self.findings, d["findings"]):
            fd.update(where=f.where, hint=f.hint, fault=f.fault)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AuditReport:
        known = {f.name for f in fields(Finding)}
        findings = tuple(
            Finding(**{**{k: v for k, v in f.items() if k in known},
                       "tensors": tuple(_diff(t) for t in f["tensors"]),
                       "seen_at": tuple(f["seen_at"])})
            for f in d.get("findings", ())
        )  # fmt: skip
        known = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in known}, "findings": findings})

    def write(self, path: str) -> None:
        """Atomically: the parent may read it while the rank runs, or after it was killed."""
        with open(path + ".tmp", "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(path + ".tmp", path)

    @classmethod
    def read(cls, path: str) -> AuditReport | None:
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, ValueError, TypeError, KeyError):
            return None


def _diff(d: dict) -> TensorDiff:
    first = d.get("first_index")
    return TensorDiff(**{**d, "ranks": tuple(d["ranks"]), "values": tuple(d.get("values", ())),
                         "first_index": None if first is None else tuple(first)})  # fmt: skip


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 8:
        return ", ".join(map(str, ranks[:8])) + f" and {len(ranks) - 8} more"
    return ", ".join(map(str, ranks))


STATE_EVERY = 16  # audited steps between two reads of the optimizer state (auditor.py)


@dataclass(frozen=True)
class AuditSettings:
    """How a rank audits its script: every `every`-th optimizer step, the report at `path`."""

    every: int = 1
    path: str | None = None
