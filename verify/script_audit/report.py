"""What the audit found, as typed records that travel from a rank to the parent (JSON).

A finding is the one `Finding` of every check (`verify/replica_audit/finding.py`), of check
"audit": one distinct divergence: at one audit point (an optimizer's step, before or
after it) and one phase, the tensors that newly differ across ranks, each with the ranks that
differ and by how much (`TensorDiff`, in its numbers), and what this usually means. A later
step where the same tensors differ again adds to the finding's `steps` (`seen_at`: the later
ones) rather than making a new one, and a
divergence that follows from an earlier one (parameters after a step whose gradients already
differed) records which (`echo_of`). Kinds: "divergence" and "layout" (the ranks audit
different sets of tensors, or are at different steps) are faults; "note" is not (buffers
that the script's wrapper does not synchronize and that differ: a documented design).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field, fields

# The phases (what a finding compared), where the hint table reads them too.
from verify.hints.phases import (  # noqa: E402, F401
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
from verify.replica_audit.finding import Finding


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
    # Under PyTorch's join() (`joins.py`): optimizer -> steps this rank took while some rank
    # had joined (run out of data), never audited; the fewest ranks still training at one of
    # them, and of how many; optimizer -> steps inside a join the audit cannot read in time
    # (led by an optimizer, or over a subgroup), never audited either.
    joined: dict[str, int] = field(default_factory=dict)
    joined_ranks: tuple[int, int] | None = None
    unseen: dict[str, int] = field(default_factory=dict)
    # Nothing trained (`motion.py`, this rank's view: every rank's where the replicas agree):
    # the optimizers whose audited gradients were exactly zero (or None) at every audited
    # step, and those whose parameters never changed over the run
    zero_gradients: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    finished: bool = False  # the script ended (or exited) and the report was written then

    @property
    def faults(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.fault)

    def to_dict(self) -> dict:
        """As JSON. Each finding has the one Finding's keys (check, phase, step, message,
        tensor, ranks, steps, where, kind, numbers, hint) and, as ever, the script audit's
        (optimizer, tensors, count, detail, echo_of, seen_at, fault)."""
        d = asdict(self)
        for f, fd in zip(self.findings, d["findings"]):
            fd.update({k: getattr(f, k) for k in _SCRIPT_KEYS})
            fd["tensors"] = list(f.numbers.get("tensors", ()))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AuditReport:
        known = {f.name for f in fields(Finding)}
        findings = tuple(
            Finding(**{**{k: v for k, v in f.items() if k in known},
                       "ranks": tuple(f["ranks"]), "steps": tuple(f["steps"])})
            for f in d.get("findings", ())
        )  # fmt: skip
        known = {f.name for f in fields(cls)}
        fewest = d.get("joined_ranks")
        return cls(**{**{k: v for k, v in d.items() if k in known}, "findings": findings,
                      "joined_ranks": None if fewest is None else tuple(fewest),
                      "zero_gradients": tuple(d.get("zero_gradients", ())),
                      "unchanged": tuple(d.get("unchanged", ()))})  # fmt: skip

    def write(self, path: str) -> None:
        """Atomically: the parent may read it while the rank runs, or after it was killed.
        Raises OSError when it cannot be written (the earlier report is left as it was, and
        no partial file beside it)."""
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(self.to_dict(), f, indent=1)
            os.replace(path + ".tmp", path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(path + ".tmp")
            raise

    @classmethod
    def read(cls, path: str) -> AuditReport | None:
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, ValueError, TypeError, KeyError):
            return None


# The script audit's own keys of a finding, kept in its JSON beside the one Finding's.
_SCRIPT_KEYS = ("optimizer", "count", "detail", "echo_of", "seen_at", "fault")

STATE_EVERY = 16  # audited steps between two reads of the optimizer state (hooks.py)


@dataclass(frozen=True)
class AuditSettings:
    """How a rank audits its script: every `every`-th optimizer step, the report at `path`."""

    every: int = 1
    path: str | None = None
