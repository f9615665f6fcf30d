"""What the measurements of the tool's own costs share: `bench-audit` (and its
`--script-audit`), `bench-tracer` and `bench-sanitize`, run by a maintainer's scripts
(`benchmarks/audit_cost.py`, `tracer_cost.py`, `sanitize_cost.py`), not by the CLI.

Each is one launch (`run_cost`) on the transformer workload with one implementation
(`CostOptions`). In every rank the one trainer (`training/trainer.py`) takes a warm-up step;
then two or three arms (a plain step, the same step with the tool's part on, or the tool's
part alone) take turns every round, the order rotating (`take_turns`, over
`timing.interleave`), every sample the slowest rank's. A cost is one arm over another, paired
per round with a 95% interval (`timing.paired`), decided against its goal where it has one
(`goal_bar`, `timing.decide`). Rank 0's dict of samples becomes the result's fields; a launch
that failed becomes a result with its verdict and the launcher's account (`base.Measured`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from verify import runs
from verify.launching import RankContext, launch
from verify.options import knob, launch_knobs
from verify.perf.base import Measured, MeasureOptions, resolve_all, say
from verify.perf.timing import Ratio, decide, interleave, paired


@dataclass(frozen=True, kw_only=True)
class CostOptions(MeasureOptions):
    """The knobs the three share: the implementation stepped and the world size (collectives
    need two ranks); a command adds the model's size and the rounds."""

    impl: str = knob("bucketed", "a registered name, package.module:Class or path/to/file.py:Class")
    world_size: int = knob(2, "ranks to start (collectives need two)", minimum=2)

    command: ClassVar[
        str
    ]  # the measurement's name (its script's row): how a bad --impl is reported

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_all((self.impl,), self.command)


def run_cost(
    options: CostOptions,
    on_rank: Callable[[RankContext, Any], dict],
    result: type[Measured],
    **launch_extra: Any,
) -> Any:
    """One launch of `on_rank(ctx, options)` on `options.world_size` ranks (`launch_extra`:
    more of `launch`'s keywords), and its `result`: rank 0's dict as fields, the machine line,
    and the torch version where `result` records one."""
    info = runs.machine_info()
    run = launch(
        on_rank,
        world_size=options.world_size,
        args=(options,),
        **launch_knobs(options),
        **launch_extra,
    )
    fields = {"machine": runs.describe_machine(info, run.threads)}
    if run.ok:
        fields |= run.values[0]
        if "torch_version" in {f.name for f in dataclasses.fields(result)}:
            fields["torch_version"] = info["torch"]
    return result.from_launch(options, run, **fields)


def take_turns(
    ctx: RankContext,
    arms: Mapping[Hashable, Callable[[], float]],
    rounds: int,
    what: str,
    every: int = 1,
) -> dict[Hashable, list[float]]:
    """`rounds` interleaved rounds of `arms` (`timing.interleave`: collectives, so every rank
    calls it alike), rank 0 saying `<what>: round r/rounds` at the first round, every `every`
    rounds after it, and at the last."""

    def each_round(r: int) -> None:
        if (r - 1) % every == 0 or r == rounds:
            say(ctx, f"{what}: round ", r, rounds)

    return interleave(arms, rounds, each_round)


def goal_bar(
    what: str, a: Iterable[float], b: Iterable[float], goal: float
) -> tuple[str, Ratio, float, str]:
    """(what, a over b paired per round, goal, the decision on `ratio <= goal`)."""
    r = paired(list(a), list(b))
    return what, r, goal, decide(r, goal)
