"""What every check returns: a verdict, every distinct finding, and how the run went.

- `verdict`: "pass" (the check ran to the end and found nothing), "fault" (a finding, or a
  rank that raised, crashed or hung), "timeout" (the time ran out before the check could
  decide: not a fault), "nothing certified" (the matrix: no cell could be judged, every
  one not claimed or n/a: not a pass), "nothing audited" (a script's audit: no optimizer
  step ran in a group of 2 or more ranks, so nothing was checked: not a pass) or "unwatched"
  (a script started ranks of its own, which the tool neither watched nor audited: not a pass
  either), "audit stopped" (a script's audit ended before the script did, with nothing
  found until then: its own report could not be written, a full disk or a removed run
  folder; the steps after it were not checked, so not a pass either). The CLI's exit code
  follows it: 0, 1, 2, 2, 2, 2 and 2.
- `Finding` (`verify/replica_audit/finding.py`: the one type of every check, the script
  audit's too): one distinct thing wrong, with the check and phase that saw it, the tensor,
  the first step, every later step it showed at again, where in the user's code when known,
  and what was measured: its `kind` (`hints/kinds.py`) and `numbers`, from which its `hint` is chosen
  (`hints/table.py`), never from its message.
  A run goes on past a finding where it can (replicas are resynchronized from rank 0), so one
  bug does not hide the next; the same finding at later steps is folded into one.
- `run_check`: the launch every check makes, and what becomes of a failed one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from verify.hints.kinds import RAISED_ON_SOME
from verify.launching import LaunchResult, launch
from verify.options import launch_knobs
from verify.replica_audit.finding import Finding

PASS, FAULT, TIMEOUT, NOTHING = "pass", "fault", "timeout", "nothing certified"
NOTHING_AUDITED = "nothing audited"
AUDIT_STOPPED = "audit stopped"
UNWATCHED = "unwatched"
EXIT_CODES = {PASS: 0, FAULT: 1, TIMEOUT: 2, NOTHING: 2, NOTHING_AUDITED: 2, AUDIT_STOPPED: 2,
              UNWATCHED: 2}  # fmt: skip
#: the phases a finding can belong to, in the order a report lists a step's findings: a race
#: first, since it is the likely cause of the step's wrong gradients or parameters
PHASES = ("construction", "race", "gradients", "step", "checkpoint", "run")


class Verdicted:
    """What every command's result carries: its `verdict` (a key of EXIT_CODES, which the CLI
    exits with) and `passed`, read from it. A mixin, not a field: each result dataclass
    declares `verdict` where its JSON has always had it."""

    verdict: str

    @property
    def passed(self) -> bool:
        return self.verdict == PASS


def collapse(findings: list[Finding]) -> tuple[Finding, ...]:
    """One finding per (check, phase, tensor, kind, place): the first, with every step it
    showed at. Order: by first step, then phase order."""
    merged: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.check, f.phase, f.tensor, f.kind, f.where)
        if key in merged:
            first = merged[key]
            steps = tuple(sorted(set(first.steps or (first.step,)) | set(f.steps or (f.step,))))
            merged[key] = replace(first, steps=steps)
        else:
            merged[key] = replace(f, steps=f.steps or (f.step,))
    return tuple(sorted(merged.values(), key=lambda f: (f.step, PHASES.index(f.phase))))


def verdict_of(findings, run: LaunchResult) -> str:
    if findings or (not run.ok and not run.timed_out):
        return FAULT
    if run.timed_out:
        return TIMEOUT
    return PASS


@dataclass(frozen=True)
class Refusal:
    """What a rank returns when the class under test cannot be driven as the contract says
    (`trainer.InterfaceError`): the check cannot run, a usage error, when every rank refuses.
    `reason` is the short form (what raised, where) for when only some ranks do: decided by
    this rank alone, so the ranks compare their refusals (`run_check`; the matrix's cells,
    `agreement.py`) before one becomes a usage error or a fault of the class."""

    message: str
    rank: int = 0
    reason: str = ""
    exception: str = ""  # the type of what the class raised
    call: str = ""  # what the tool was constructing when the class raised ("the optimizer")

    @classmethod
    def of(cls, exc, rank: int) -> Refusal:
        """This rank's refusal, from the `InterfaceError` it raised."""
        return cls(str(exc), rank, exc.reason, exc.exception, exc.call)

    def numbers(self) -> dict:
        """What a finding of a raise on some ranks only measured (`raised_on_some`)."""
        return {"exception": self.exception, "call": self.call}


def run_check(
    rank_fn: Callable[..., Any], options
) -> tuple[LaunchResult, list[Any], tuple[Finding, ...]]:
    """Launch `rank_fn(ctx, options.train_spec(), options.sanitize)` as `options` says, and
    return the run, every report a rank left (its return value, or the partial report a
    failing rank returned in a `Raised`) and the finding of a class that raised on some
    ranks only (an interface that holds on the others is not a usage error: a fault).

    Raises ValueError (one line, exit 2) when every rank refused (`Refusal`)."""
    run = launch(
        rank_fn,
        world_size=options.world_size,
        args=(options.train_spec(), options.sanitize),
        **launch_knobs(options),
    )
    reports = [o.value for o in run.outcomes if o.value is not None]
    refusals = [r for r in reports if isinstance(r, Refusal)]
    reports = [r for r in reports if not isinstance(r, Refusal)]
    if refusals and len(refusals) == run.world_size:
        raise ValueError(refusals[0].message)
    if not refusals:
        return run, reports, ()
    return run, reports, (raised_on_some(refusals, run.world_size),)


def raised_on_some(refusals: list[Refusal], world_size: int) -> Finding:
    """The finding of a class that raised on the `refusals`' ranks and went on on the others."""
    first = min(refusals, key=lambda r: r.rank)
    phase = "construction" if first.call else "run"  # a call is named where construction raised
    ranks = tuple(sorted(r.rank for r in refusals))
    message = only_some_text(refusals, world_size)
    numbers = {**first.numbers(), "ranks": list(ranks), "world_size": world_size}
    return Finding("run", phase, 0, message, ranks=ranks, kind=RAISED_ON_SOME, numbers=numbers)


def only_some_text(refusals: list[Refusal], world_size: int) -> str:
    """`only rank 2 raised: constructing the optimizer raised ...; ranks 0, 1 did not ...`:
    what the lowest of the ranks that refused raised, and who did not."""
    ranks = sorted(r.rank for r in refusals)
    others = [r for r in range(world_size) if r not in ranks]
    reason = min(refusals, key=lambda r: r.rank).reason
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    went_on = f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    return (
        f"only {who} raised: {reason}; {went_on} did not (the class must behave alike on every "
        "rank: raising on some ranks only is a fault of the class, not an interface problem)"
    )


def failure_text(run: LaunchResult) -> str | None:
    """The launcher's summary of a run that did not end with every rank returning."""
    return None if run.ok else run.summary()


def every_rank(n: int) -> str:
    """ "all 3 ranks", "both ranks", "the one rank": for headlines."""
    return {1: "the one rank", 2: "both ranks"}.get(n, f"all {n} ranks")
