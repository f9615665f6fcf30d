"""What `bench` found, and the bars it holds the variants to.

Step-time bars compare two variants round by round (`timing.paired`: the geometric mean of the
per-round ratios, with a 95% interval) and decide three ways (`timing.decide`): "met" when the
whole interval is within the goal, "missed" when it is wholly outside, "undecided" when the
machine's noise is wider than the margin. The memory bars are exact byte counts, met or
missed: ZeRO-1's state against the unsharded AdamW's, and each sharded rung (`SHARDED`)
against what it promises to shard, by the memory check's bound (`verify/checks/memory.py`).
The sharded rungs' step times are compared with FSDP2's (`SHARDED_REFERENCE`), paired per
round with an interval, without a goal: no bar is set for them. A missed or undecided bar is
reported, never hidden; it is not a failed run (the verdict says whether the ranks finished).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from verify.checks.memory import MemoryResult
from verify.perf.alphabeta import AlphaBeta, MiB, predict_exposed
from verify.perf.base import Measured
from verify.perf.timing import MET, MISSED, UNDECIDED, Ratio, decide, paired

LOCAL = "local"  # no wrapper, no communication: the compute-only reference
REFERENCE = "torch-ddp"
SHARDED_REFERENCE = "torch-fsdp"  # what the sharded rungs' step times are compared with
SHARDED = ("zero2", "zero3", SHARDED_REFERENCE)  # the sharded rungs, measured against 1/N
ZERO1_MEMORY = ("zero1", "torch-zero", "bucketed")  # ZeRO-1's bars and phase table read these
# the ladder whose memory bench measures, each alone, in the ladder's order
MEMORY_VARIANTS = ("bucketed", "zero1", "torch-zero", *SHARDED)
BAR_DDP, BAR_STATE, BAR_ZERO, BAR_BUSBW = 1.05, 1.01, 1.0, 0.8


@dataclass(frozen=True)
class Bar:
    """One goal: the measured `value`, the `goal` as text ("<= 1.05"), the `decision` (met,
    missed or undecided) and, for timed bars, the paired `ratio` whose interval it rests on
    (None: an exact count)."""

    what: str
    value: float
    goal: str
    decision: str
    ratio: Ratio | None = None
    detail: str = ""

    @property
    def met(self) -> bool | None:
        """True (met), False (missed) or None (undecided: the noise is wider than the margin)."""
        return {MET: True, MISSED: False, UNDECIDED: None}[self.decision]

    def to_dict(self) -> dict:
        r = self.ratio
        return {
            "what": self.what,
            "value": self.value,
            "goal": self.goal,
            "met": self.met,
            "decision": self.decision,
            "interval": None if r is None else [r.low, r.high],
            "rounds": None if r is None else r.rounds,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class BenchResult(Measured):
    """Every sample `bench` took (times are the slowest rank's seconds), per rank memory, and
    the fits; `bars()` and the helpers below turn them into the report's numbers."""

    options: object  # BenchOptions
    verdict: str
    steps: dict = field(default_factory=dict)  # name -> seconds per round
    sweep: dict = field(default_factory=dict)  # "impl@mb" -> seconds per round; LOCAL too
    memory: tuple = ()  # per rank: {impl: {phase: {params, grads, optimizer, allocated}}}
    shards: dict = field(default_factory=dict)  # impl -> MemoryResult (the memory check's)
    plan: dict = field(default_factory=dict)  # zero1's ShardPlan numbers (parameter bytes)
    fit: AlphaBeta | None = None
    grad_bytes: int = 0
    backward_s: float = 0.0
    bandwidth: dict = field(default_factory=dict)
    parameters: int = 0
    run_dir: str | None = None
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()

    def median(self, name: str, table: str = "steps") -> float:
        return statistics.median(getattr(self, table)[name])

    def state_bytes(self, impl: str) -> list[int]:
        """Optimizer-state bytes on each rank after the first step."""
        return [rank[impl]["after step"]["optimizer"] for rank in self.memory if impl in rank]

    def predicted_exposed(self, bucket_mb: float) -> float | None:
        if self.fit is None or not self.grad_bytes:
            return None
        return predict_exposed(self.fit, self.grad_bytes, self.backward_s, bucket_mb * MiB)

    def paired(self, a: str, b: str) -> Ratio:
        """a's step over b's step, paired per round (`timing.paired`): the variants of one
        round ran seconds apart, so the machine's load drifting between rounds cancels."""
        return paired(self.steps[a], self.steps[b])

    def sweep_exposed(self, key: str) -> float:
        """Median over the sweep's rounds of (step - local step) in seconds, paired per round."""
        return statistics.median(x - loc for x, loc in zip(self.sweep[key], self.sweep[LOCAL]))

    def exposed_share(self, name: str) -> float:
        """Median over rounds of (step - local step) / step, paired per round."""
        return statistics.median(
            (x - loc) / x for x, loc in zip(self.steps[name], self.steps[LOCAL])
        )

    def bars(self) -> list[Bar]:
        """The bars that this run's variants allow (module docstring)."""
        out = []
        if {"bucketed", REFERENCE} <= self.steps.keys():
            out.append(
                self._step_bar("bucketed / torch-ddp step time", "bucketed", REFERENCE, BAR_DDP)
            )
        if "zero1" in self.steps and self.memory and self.state_bytes("zero1"):
            out += self._state_bars()
        if {"zero1", "torch-zero"} <= self.steps.keys():
            out.append(
                self._step_bar("zero1 / torch-zero step time", "zero1", "torch-zero", BAR_ZERO)
            )
        out += [self._shard_bar(impl) for impl in SHARDED if impl in self.shards]
        if self.bandwidth:
            b = self.bandwidth
            r = paired(b["raw_s"], b["ours_s"])  # raw time / ours = our busbw / raw busbw
            medians = statistics.median(b["raw_s"]) / statistics.median(b["ours_s"])
            out.append(
                Bar(
                    "bucket all-reduce busbw / raw all_reduce busbw",
                    r.value,
                    f">= {BAR_BUSBW}",
                    decide(r, BAR_BUSBW, at_most=False),
                    r,
                    f"{len(b['buckets'])} bucket{'s' if len(b['buckets']) != 1 else ''}, {sum(b['buckets']) / MiB:.1f} MiB; ratio of "
                    f"medians {medians:.3f}",
                )
            )
        return out

    def _step_bar(self, what: str, a: str, b: str, goal: float) -> Bar:
        r = self.paired(a, b)
        detail = (
            f"ratio of medians {self.median(a) / self.median(b):.3f}, "
            f"of minimums {min(self.steps[a]) / min(self.steps[b]):.3f}"
        )
        return Bar(what, r.value, f"<= {goal}", decide(r, goal), r, detail)

    def against_fsdp(self, name: str) -> Ratio | None:
        """`name`'s step over FSDP2's, paired per round; None when either was not timed."""
        if name not in self.steps or SHARDED_REFERENCE not in self.steps:
            return None
        return self.paired(name, SHARDED_REFERENCE)

    def _shard_bar(self, impl: str) -> Bar:
        """The kinds `impl` promises to shard, each rank's bytes over 1/N of the unsharded
        total (1.00: a perfect shard; the value is the largest), judged by the memory check's
        bound (`KindMemory.sharded`: the ranks hold each kind once, the largest rank within
        (2 - 1/N) x max(total / N, largest tensor), plus row padding)."""
        result: MemoryResult = self.shards[impl]
        n = len(result.kinds[0].per_rank)
        per_kind = {
            k.kind: max(k.per_rank) * n / k.unsharded if k.unsharded else 0.0
            for k in result.kinds
            if k.kind in result.promised
        }
        detail = ", ".join(f"{kind} {x:.4f}" for kind, x in per_kind.items())
        return Bar(
            f"{impl} largest rank / (unsharded / N), kinds it shards",
            max(per_kind.values(), default=0.0),
            "memory check's bound",
            MET if result.passed else MISSED,
            None,
            detail + ("" if result.passed else "; " + "; ".join(result.failures)),
        )

    def _state_bars(self) -> list[Bar]:
        """ZeRO-1's optimizer state, exact: balanced across ranks as far as whole parameters
        allow, and summed over ranks equal to the unsharded optimizer's."""
        state = self.state_bytes("zero1")
        ideal = sum(state) / len(state)
        r, bound = max(state) / ideal, self.plan["bound"] / self.plan["ideal"]
        goal = f"<= {max(BAR_STATE, bound):.4f}" + (" (the bound)" if bound > BAR_STATE else "")
        met = r <= max(BAR_STATE, bound * 1.0005)
        out = [
            Bar(
                "zero1 largest rank's optimizer state / (total / N)",
                r,
                goal,
                MET if met else MISSED,
                None,
                f"bound whole parameters allow: {bound:.4f} (in parameter bytes)",
            )
        ]
        unsharded = self.state_bytes("bucketed")
        if unsharded:
            equal = sum(state) == unsharded[0]
            out.append(
                Bar(
                    "zero1 state summed over ranks / unsharded AdamW state",
                    sum(state) / unsharded[0],
                    "== 1",
                    MET if equal else MISSED,
                    None,
                    f"{sum(state)} vs {unsharded[0]} bytes",
                )
            )
        return out

    def to_dict(self) -> dict:
        d = {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("options", "fit", "memory", "shards")
        }
        d["ok"] = self.ok
        d["options"] = self.options.to_dict()
        d["memory"] = list(self.memory)
        d["shards"] = {impl: _shards_dict(r) for impl, r in self.shards.items()}
        d["alpha_beta"] = dataclasses.asdict(self.fit) if self.fit else None
        if self.ok:
            d["medians_s"] = {k: self.median(k) for k in self.steps}
            d["bars"] = [b.to_dict() for b in self.bars()]
            d["against_fsdp"] = {
                name: r.to_dict() for name in self.steps if (r := self.against_fsdp(name))
            }
        return d


def _shards_dict(result: MemoryResult) -> dict:
    """The memory check's result with its derived numbers (ratios, sharded) spelled out."""
    return {
        "promised": list(result.promised),
        "passed": result.passed,
        "kinds": {
            k.kind: {
                "per_rank": list(k.per_rank),
                "unsharded": k.unsharded,
                "ratios": list(k.ratios),
                "sharded": k.sharded,
            }
            for k in result.kinds
        },
    }
