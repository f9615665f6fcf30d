"""What a diagnosis says: the findings about a run's collectives, and the verdict.

Data only (`diagnose.py` reaches them): a `TraceFinding` names a culprit rank, what it did wrong and
where; a `Diagnosis` is the verdict ("ok", "hang", "crash", "desync"; "timeout" and "unwatched"
when there is none) with its headline, every
finding, and one line per rank saying where it was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TraceFinding:
    kind: str  # "missing", "op mismatch", ..., "reduce-op mismatch", "crashed", "raised", ...
    rank: int  # the culprit
    message: str  # one line
    collective: str | None = None  # e.g. "all_reduce #12 on world [float32 (64,) SUM]"
    site: str | None = None  # where the collective was issued (the waiting ranks' call site)
    culprit_site: str | None = None  # what the culprit was doing instead, where
    hangs: bool = True  # False: a desync that completes with wrong results
    op: str | None = None  # the collective's op ("all_reduce"): typed, for the hint


@dataclass(frozen=True)
class Diagnosis:
    # "ok" | "hang" | "crash" | "desync" | "timeout" (no verdict in time) | "unwatched" (a
    # rank started ranks of its own, which nothing watched: no verdict)
    verdict: str
    headline: str
    culprit: int | None = None
    collective: str | None = None
    site: str | None = None
    findings: tuple[TraceFinding, ...] = ()
    ranks: tuple[str, ...] = ()  # one line per rank: where it is
    stall_timeout_s: float | None = None
    detection_s: float | None = None  # from the last progress of any rank to the verdict
    files: dict = field(default_factory=dict)  # name -> path of captured logs (report folder)

    @property
    def faulty(self) -> bool:
        """A fault was found: a hang, a crash or a desync (a timeout is no verdict)."""
        return self.verdict in ("hang", "crash", "desync")

    def text(self) -> str:
        lines = [f"{self.verdict.upper()}: {self.headline}"]
        if self.detection_s is not None and self.stall_timeout_s is not None:
            lines.append(
                f"  detected {self.detection_s:.1f}s after the last progress of any rank "
                f"(stall timeout {self.stall_timeout_s:g}s)"
            )
        more = [f for f in self.findings if f.message != self.headline]
        if more:
            lines.append("also:")
            lines += [f"  - {f.message}" for f in more]
        if self.ranks:
            lines.append("ranks:")
            lines += [f"  {line}" for line in self.ranks]
        if self.files:
            lines.append("captured:")
            lines += [f"  {name}: {path}" for name, path in self.files.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)
