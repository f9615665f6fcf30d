"""The equivalence check: does data-parallel training compute what one process computes?

Every rank trains its replica (`training/trainer.py`) beside a single-process reference fed
the same global batches (`reference.py`), and compares, at construction, after every gradient
synchronization and after every optimizer step, gradients, parameters and buffers, within the
tolerances `tolerances.py` derives. The training knobs cover what real training does: AdamW
or SGD over two parameter groups, a StepLR scheduler, gradient accumulation under `no_sync()`,
`zero_grad(set_to_none=False)`, and an optimizer state_dict round trip midway (full,
consolidated or per-rank checkpoints, `training/checkpoint.py`).

The report gives every tensor's worst error against its tolerance, the first divergence (the
step, the tensor, gradients or parameters first) and every distinct finding.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from verify.checks.divergence import divergences
from verify.checks.failures import failure_findings
from verify.checks.options import CheckOptions
from verify.checks.reference import Reference, TensorError
from verify.checks.sanitizing import training
from verify.checks.verdict import (
    FAULT,
    PASS,
    Finding,
    Refusal,
    Verdicted,
    collapse,
    every_rank,
    failure_text,
    run_check,
    verdict_of,
)
from verify.hints.table import situation_of, with_hints
from verify.launching import Raised, RankContext
from verify.options import knob
from verify.training.hooks import Progress
from verify.training.interface import InterfaceError
from verify.training.trainer import OPTIMIZERS, SCHEDULER_GAMMA, TRAIN_DEFAULTS, TrainSpec

KINDS = ("gradients", "parameters", "buffers")  # order of the checks within a step


@dataclass(frozen=True, kw_only=True)
class EquivalenceOptions(CheckOptions):
    """Beyond the common check knobs, how the replica and the reference are trained."""

    optimizer: str = knob(
        TRAIN_DEFAULTS.optimizer, "the optimizer of both sides", choices=OPTIMIZERS
    )
    lr: float = knob(TRAIN_DEFAULTS.lr, "learning rate of the first parameter group (the "
                     "second: half)", positive=True)  # fmt: skip
    weight_decay: float = knob(
        TRAIN_DEFAULTS.weight_decay, "weight decay of the first parameter group", minimum=0
    )
    accumulate: int = knob(TRAIN_DEFAULTS.accumulate, "micro-batches per step, all but the "
                           "last under no_sync()", minimum=1)  # fmt: skip
    set_to_none: bool = knob(
        TRAIN_DEFAULTS.set_to_none, "zero_grad(set_to_none=False): keep zeroed gradient "
        "tensors instead of None", negate="--keep-grads",
    )  # fmt: skip
    # On here, off in TrainSpec: equivalence exists to catch what a scheduler or a resumed
    # state does to a sharded optimizer, so it plays both unless told not to.
    scheduler: bool = knob(
        True, "no StepLR after each step (by default the lr halves after every step)",
        negate="--no-scheduler",
    )  # fmt: skip
    round_trip: bool = knob(
        True, "no optimizer state_dict round trip (by default: saved and reloaded midway)",
        negate="--no-round-trip",
    )  # fmt: skip
    command: str = knob("equivalence", cli=False)

    @property
    def round_trip_step(self) -> int | None:
        """The step after which the optimizer state is saved and reloaded, if any."""
        return self.steps // 2 if self.round_trip and self.steps >= 2 else None


@dataclass(frozen=True)
class EquivalenceReport:
    """One run's answer (the same on every rank, after the ranks' reports are merged).

    `rows` holds the worst error of every tensor over all steps and ranks, in check order;
    `first_divergence` the first tensor over tolerance at the earliest failing check (step,
    then gradients before parameters), `also_diverged` how many other tensors failed there,
    and `findings` every distinct one. `unsupported` says why the run could not be judged
    (`accumulate > 1` for a wrapper without `no_sync()`): neither a pass nor a fault.
    """

    rows: tuple[TensorError, ...] = ()
    first_divergence: TensorError | None = None
    also_diverged: int = 0
    checks: int = 0
    notes: tuple[str, ...] = ()
    unsupported: str | None = None
    findings: tuple[Finding, ...] = ()

    @property
    def passed(self) -> bool:
        return self.unsupported is None and not self.findings

    def describe(self) -> str:
        if self.unsupported:
            return f"NOT CLAIMED: {self.unsupported}"
        if not self.findings:
            return f"PASS: all {self.checks} tensor checks within tolerance"
        first = self.findings[0]
        if self.first_divergence is not None and first.phase in ("gradients", "step"):
            more = f" (and {self.also_diverged} more tensors there)" if self.also_diverged else ""
            return f"FAULT: first divergence at {self.first_divergence.describe()}{more}"
        return f"FAULT: {first.describe()}"


@dataclass(frozen=True)
class EquivalenceResult(Verdicted):
    """The verdict of `check_equivalence`, the merged report, and how the run went."""

    options: EquivalenceOptions
    verdict: str
    report: EquivalenceReport | None = None
    failure: str | None = None  # a rank raised, crashed, hung or timed out: the launcher's words
    elapsed_s: float = 0.0
    threads: str = ""
    notes: tuple[str, ...] = ()
    # a failed run's diagnosis and raise as typed findings, with their hints (`failures.py`)
    failure_findings: tuple[Finding, ...] = ()

    @property
    def findings(self) -> tuple[Finding, ...]:
        return self.report.findings if self.report is not None else ()

    @property
    def headline(self) -> str:
        o = self.options
        if self.passed:
            return (
                f"PASS: gradients and parameters match one process on {every_rank(o.world_size)} "
                f"for {o.steps} step{'s' if o.steps != 1 else ''} ({self.report.checks} tensor "
                "checks)"
            )
        if self.report is not None and self.report.findings:
            findings = self.report.findings
            if len(findings) == 1:
                return self.report.describe()
            # Distinct findings are distinct bugs: name each, not the first and a count.
            first = self.report.describe().removeprefix("FAULT: ")
            rest = [f.message.split(" (and ")[0] for f in findings[1:3]]
            more = len(findings) - 3
            tail = f"; and {more} more" if more > 0 else ""
            return (
                f"FAULT: {len(findings)} distinct findings: 1. {first}; "
                + "; ".join(f"{i}. {m}" for i, m in enumerate(rest, 2))
                + tail
            )
        word = "FAULT" if self.verdict == FAULT else "TIMEOUT"
        return f"{word}: {(self.failure or '').splitlines()[0] if self.failure else ''}"

    def to_dict(self) -> dict:
        """The `--json` document. Every distinct finding is at the top level, `findings`, as
        in every check's, and only there: the report's other fields stay under `report`."""
        doc = {"check": "equivalence", **asdict(self), "passed": self.passed}
        doc["findings"] = doc["report"].pop("findings") if doc["report"] is not None else []
        return _finite(doc | {"headline": self.headline})


def check_equivalence(options: EquivalenceOptions) -> EquivalenceResult:
    """Run the equivalence check; a failing rank or a hang comes back as a failed result."""
    start = time.perf_counter()
    run, reports, raised = run_check(equivalence_on_rank, options)
    report = reports[0] if reports else None
    if raised:  # a class that raised on some ranks only: the first finding
        report = report or EquivalenceReport()
        report = replace(report, findings=raised + report.findings)
    situation = situation_of(options)
    if report is not None:  # each finding with its hint, for the text and for --json
        report = replace(report, findings=with_hints(report.findings, situation))
    findings = report.findings if report is not None else ()
    verdict = verdict_of(findings, run)
    if report is not None and report.unsupported and run.ok:
        verdict = PASS  # nothing claimed, nothing failed: the CLI says "not claimed"
    return EquivalenceResult(
        options, verdict, report=report, failure=failure_text(run),
        elapsed_s=time.perf_counter() - start, threads=run.threads, notes=run.notes,
        failure_findings=failure_findings(run, situation),
    )  # fmt: skip


def run_equivalence_on_rank(
    ctx: RankContext, spec: TrainSpec, sanitize: bool = False
) -> EquivalenceReport | Refusal:
    """The check as one rank runs it, inside an already launched job. A collective: call it
    on every rank with the same spec. Every rank returns the same report; training that
    raises raises here.

    It builds everything it uses, seeds explicitly, and restores torch's random state on
    return, so runs can follow each other in one process in any order.
    """
    return Raised.unwrap(equivalence_on_rank(ctx, spec, sanitize))


def equivalence_on_rank(
    ctx: RankContext, spec: TrainSpec, sanitize: bool = False
) -> EquivalenceReport | Refusal | Raised:
    """`run_equivalence_on_rank` as `check_equivalence` launches it: training that raised
    comes back as a `Raised` carrying this rank's comparisons up to then (the launcher
    reports the rank as failed, with them as its partial value)."""
    reference = Reference()
    guard = None
    devices = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            hooks = [reference, Progress(f"equivalence {spec.impl} on {spec.workload}")]
            with training(ctx, spec, hooks, sanitize=sanitize) as (trainer, guard):
                if spec.accumulate > 1 and not hasattr(trainer.wrapped, "no_sync"):
                    why = "gradient accumulation: the wrapper has no no_sync()"
                    return EquivalenceReport(unsupported=why)
                trainer.run()
        except InterfaceError as exc:
            return Refusal.of(exc, ctx.rank)
        except Exception as exc:  # the launcher reports it, with what was found before it
            return Raised(exc, _merge([_local(reference, guard, spec)]))
    return merged(ctx, reference, guard, spec)


def merged(ctx: RankContext, reference: Reference, sanitize, spec: TrainSpec) -> EquivalenceReport:
    """Every rank's report (`_local`) in one (`_merge`), the same on every rank: a collective
    once training has ended, on every rank."""
    local = _local(reference, sanitize, spec)
    if ctx.world_size == 1:
        return _merge([local])
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, local)
    return _merge(gathered)


def _local(reference: Reference, sanitize, spec: TrainSpec) -> EquivalenceReport:
    """This rank's report, with the race sanitizer's findings and notes when it ran."""
    findings, notes = list(reference.findings), [*_notes(spec), *reference.notes]
    if sanitize is not None:
        findings += sanitize.findings
        notes += sanitize.notes
    return EquivalenceReport(
        rows=tuple(reference.checked), notes=tuple(notes), findings=tuple(findings)
    )


def _notes(spec: TrainSpec) -> tuple[str, ...]:
    notes = [
        f"reference: one process on the global batch (fed in the ranks' shards), "
        f"{spec.optimizer} over 2 parameter groups (lr {spec.lr:g}, {spec.lr * 0.5:g})"
        + (f", StepLR gamma {SCHEDULER_GAMMA}" if spec.scheduler else "")
    ]
    if spec.round_trip_step is not None:
        what = "model and optimizer" if spec.round_trip_model else "optimizer"
        notes.append(f"{what} state_dict round trip after step {spec.round_trip_step}")
    if spec.accumulate > 1:
        notes.append(f"{spec.accumulate} micro-batches per step, all but the last in no_sync()")
    if not spec.set_to_none:
        notes.append("zero_grad(set_to_none=False)")
    if spec.same_init:
        notes.append("--same-init: every rank built the model from the same seed")
    return tuple(notes)


# --- merging the ranks' answers ------------------------------------------------------------


def _merge(reports: list[EquivalenceReport]) -> EquivalenceReport:
    """One report from every rank's list of checks: the worst error of each tensor, the
    first tensor over tolerance at the earliest failing check (lowest rank, model order),
    and the distinct findings (`_divergences`)."""
    if any(r.unsupported for r in reports):
        return next(r for r in reports if r.unsupported)
    worst: dict[tuple[str, str], TensorError] = {}
    for report in reports:
        for e in report.rows:
            key = (e.kind, e.tensor)
            if key not in worst or e.ratio > worst[key].ratio:
                worst[key] = e
    rows = sorted(worst.values(), key=lambda e: KINDS.index(e.kind))  # stable: model order
    failed = sorted((e for r in reports for e in r.rows if not e.passed), key=_when)
    first, also = None, 0
    if failed:
        first = failed[0]
        also = len({(e.kind, e.tensor) for e in failed if _when(e) == _when(first)}) - 1
    findings = [f for r in reports for f in r.findings]
    said = {(f.phase, f.step) for f in findings if f.phase == "construction"}
    # The reference already reported construction (with the hint): no second line for it.
    findings += [d for d in divergences(failed, len(reports)) if (d.phase, d.step) not in said]
    return EquivalenceReport(
        rows=tuple(rows),
        first_divergence=first,
        also_diverged=also,
        checks=sum(len(r.rows) for r in reports),
        notes=reports[0].notes,
        findings=collapse(findings),
    )


def _when(e: TensorError) -> tuple[int, int]:
    # Parameters and buffers are checked together after the step; gradients before it.
    return (e.step, 0 if e.kind == "gradients" else 1)


def _finite(obj):
    """JSON has no infinity: non-finite floats become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
