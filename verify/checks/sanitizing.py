"""`--sanitize` for the checks: the race sanitizer (`verify/sanitize/`) attached to the trainer.

`training(ctx, spec, hooks, sanitize=True)` builds the trainer with a `Sanitizer` installed
before the class under test is constructed (a sharded optimizer may issue async broadcasts in its constructor),
names the model's parameters and gradients for the reports, marks each step, reports at the
end of each step every work never waited on, and runs the checks' own hooks quietly (what the
audit and the reference read is the tool's, not the code under test's). Its race findings
become the check's findings ("race" phase), beside what the check itself found. Under
adversarial completion most races also change the numbers the same way on every run (a
division or a step before `wait()`, a broadcast never waited on), so equivalence or
consistency confirms them as wrong results too; a staging buffer refilled while in flight
keeps its right numbers there (the collective read its input at issue) and is caught by the
access report alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from verify.checks.verdict import Finding
from verify.hints import kinds
from verify.launching import RankContext
from verify.training.hooks import Hooks
from verify.training.trainer import Trainer, TrainSpec


class SanitizeHooks(Hooks):
    """Steps and names for the sanitizer; `findings` and `notes` for the report."""

    def __init__(self, rank: int) -> None:
        from verify.sanitize import Sanitizer

        self.sanitizer = Sanitizer(rank=rank)
        self.sanitizer.install()
        self.notes: list[str] = []

    def after_build(self, run: Trainer) -> None:
        from verify.sanitize import blind_spots

        self.sanitizer.name_tensors(run.model.named_parameters())
        self.sanitizer.end_step()  # what the constructor issued must be waited on by now
        self.notes += [f"--sanitize: {spot}" for spot in blind_spots(run.wrapped)]

    def before_step(self, run: Trainer, step: int) -> None:
        self.sanitizer.set_step(step)

    def after_step(self, run: Trainer, step: int) -> None:
        self.sanitizer.end_step()

    def after_load(self, run: Trainer, step: int, error) -> None:
        self.sanitizer.name_tensors(run.model.named_parameters())  # a fresh model's, if rebuilt
        self.sanitizer.end_step()

    @property
    def findings(self) -> list[Finding]:
        return [
            Finding(
                "sanitize",
                "race",
                r.step,
                r.message,
                r.tensor,
                (r.rank,),
                (r.step,),
                r.accessed_at or r.issued_at,
                kind=_RACE[r.kind],
                numbers=_race_numbers(r),
            )  # fmt: skip
            for r in self.sanitizer.findings
        ]

    def close(self) -> None:
        stats = self.sanitizer.stats
        self.notes.append(
            f"--sanitize: {stats.collectives} async collectives tracked, {stats.ops_checked} "
            "operators checked while one was in flight"
        )
        self.sanitizer.uninstall()


@contextlib.contextmanager
def training(
    ctx: RankContext, spec: TrainSpec, hooks: list[Hooks], *, sanitize: bool
) -> Iterator[tuple[Trainer, SanitizeHooks | None]]:
    """The trainer a check runs, with the sanitizer attached after `hooks` when asked (see
    the module docstring); the sanitizer is uninstalled on the way out, whatever happens."""
    if not sanitize:
        yield Trainer(ctx, spec, tuple(hooks)), None
        return
    guard = SanitizeHooks(ctx.rank)
    try:
        yield Trainer(ctx, spec, (*hooks, guard), quiet=guard.sanitizer.quiet), guard
    finally:
        guard.close()


# the sanitizer's kinds of race (`sanitize/findings.py`) as kinds of finding
_RACE = {
    "never waited": kinds.NEVER_WAITED,
    "read while in flight": kinds.READ_IN_FLIGHT,
    "write while in flight": kinds.WRITE_IN_FLIGHT,
}


def _race_numbers(r) -> dict:
    """What the sanitizer measured of a race (`RaceFinding`): the operator, the access, the
    collective, and whether the tensor touched is a gradient (named `<param>.grad`)."""
    return race_numbers(r.kind, r.op, r.tensor, r.collective.op, r.rank, r.count)


def race_numbers(kind: str, op: str, tensor: str, collective: str, rank: int, count: int):
    """A race's numbers (`_race_numbers`), from its fields."""
    access = {kinds.READ_IN_FLIGHT: "read", kinds.WRITE_IN_FLIGHT: "write"}.get(_RACE[kind])
    return {
        "op": op, "access": access, "collective": collective, "rank": rank,
        "gradient": tensor.endswith(".grad"), "count": count,
    }  # fmt: skip


def race_hint(race: dict, world_size: int) -> str | None:
    """The hint of a race as a watched run's JSON holds it (`RaceFinding.to_dict`), in a run
    of `world_size` ranks."""
    from verify.hints.table import Situation, hint_for

    numbers = race_numbers(
        race["kind"], race["op"], race["tensor"], race["collective"]["op"], race["rank"],
        race.get("count", 1),
    )  # fmt: skip
    found = Finding("sanitize", "race", race["step"], "", kind=_RACE[race["kind"]], numbers=numbers)
    return hint_for(found, Situation(world_size=world_size))
