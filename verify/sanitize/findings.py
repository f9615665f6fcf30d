"""What the sanitizer reports: one `RaceFinding` per distinct race, and its own cost.

Findings are plain frozen dataclasses of strings and ints, so a rank can return them through
the launcher and the parent can print, compare or serialize them.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace

WRITE_WHILE_IN_FLIGHT = "write while in flight"
READ_WHILE_IN_FLIGHT = "read while in flight"
NEVER_WAITED = "never waited"
KINDS = (WRITE_WHILE_IN_FLIGHT, READ_WHILE_IN_FLIGHT, NEVER_WAITED)


@dataclass(frozen=True)
class CollectiveRef:
    """Which collective: its op, its number within its group since the sanitizer was installed
    (from 1; point-to-point ops are numbered per (group, peer), as the collective tracer does),
    and the group ("world", or "pg[0,2]" by global ranks)."""

    op: str
    seq: int
    group: str

    def describe(self) -> str:
        """`all_reduce #12 on world`."""
        return f"{self.op} #{self.seq} on {self.group}"


@dataclass(frozen=True)
class RaceFinding:
    """One race on memory an async collective holds, as one rank saw it.

    `op` is the operator that touched the memory (`div_`, `copy_`, `_foreach_add_`, or a
    collective such as `all_reduce` that was handed memory another collective still held); for
    "never waited" it is the collective's own op. `tensor` is the touched tensor's name where
    `Sanitizer.name_tensors` gave one, else a description. Sites are "file:line (function)" of
    the innermost frame outside torch and `verify/`, or what the tool was doing, in words
    ("in the optimizer's step(), called by the tool's training step"). `step` is the first step the race was seen
    at; `count` how many times it was seen (same kind, op, tensor, collective and sites).
    """

    kind: str
    rank: int
    step: int
    op: str
    tensor: str
    collective: CollectiveRef
    issued_at: str
    accessed_at: str | None  # None for "never waited"
    count: int = 1

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @property
    def message(self) -> str:
        """One line a user can act on."""
        times = f"; seen {self.count} times" if self.count > 1 else ""
        where = f"step {self.step}, rank {self.rank}{times}"
        coll = self.collective.describe()
        if self.kind == NEVER_WAITED:
            return (
                f"{coll} of {self.tensor} (issued {_at(self.issued_at)}) was never waited on, "
                f"nor its future completed, by the end of the step; {where}"
            )
        verb = "wrote" if self.kind == WRITE_WHILE_IN_FLIGHT else "read"
        return (
            f"`{self.op}` {verb} {self.tensor} {_at(self.accessed_at)} while {coll} was in "
            f"flight (issued {_at(self.issued_at)}); {where}"
        )

    def key(self) -> tuple:
        """What makes two sightings the same finding."""
        c = self.collective
        return (self.kind, self.op, self.tensor, c.op, c.group, self.issued_at, self.accessed_at)

    def to_dict(self) -> dict:
        return {**asdict(self), "message": self.message}


@dataclass(frozen=True)
class SanitizerStats:
    """Where the sanitizer's time went, for the cost benchmark and the report."""

    collectives: int  # collective calls that went through the wrappers (blocking ones too)
    tracked: int  # async ones whose memory was held until completion
    windows: int  # times the access check was switched on (a first issue, an armed backward)
    armed_backwards: int  # backward passes checked from their start (see the package docstring)
    ops_seen: int  # operators that entered the check while it was on
    ops_checked: int  # of those, the ones compared against memory in flight
    check_s: float  # seconds classifying and comparing (not the dispatcher's own detour)
    copy_s: float  # seconds in snapshots and copy-backs (adversarial completion)
    findings: int  # distinct findings


class FindingLog:
    """Distinct findings in order of first sighting, each with its count (thread-safe)."""

    def __init__(self) -> None:
        self._first: dict[tuple, RaceFinding] = {}
        self._counts: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def add(self, finding: RaceFinding) -> None:
        key = finding.key()
        with self._lock:
            self._first.setdefault(key, finding)
            self._counts[key] = self._counts.get(key, 0) + 1

    def findings(self) -> tuple[RaceFinding, ...]:
        with self._lock:
            return tuple(replace(f, count=self._counts[k]) for k, f in self._first.items())

    def __len__(self) -> int:
        return len(self._first)


def _at(site: str | None) -> str:
    """`at file:line (function)`, or a site in words ("in the optimizer's step() ...")."""
    return site if site and site.startswith("in ") else f"at {site}"
