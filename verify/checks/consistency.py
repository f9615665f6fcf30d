"""The consistency check: do all replicas hold bitwise identical state at every step?

Trains the implementation (`training/trainer.py`) and audits (`audit.py`) right after
construction, after every gradient synchronization, after every optimizer step, and right
after an optimizer state_dict round trip:

- parameters and buffers: always;
- gradients: after `finish_gradient_synchronization()` (or the backward of wrappers that
  synchronize inside backward), where every rank must hold the same averaged gradient;
- optimizer state: for replicated optimizers only (a sharded one keeps different state per
  rank by design);
- the shard layout (`layout.py`), right after construction and after step 1, where it is
  declared (DTensor placements, or the wrapper's `shard_rows()`): the shards of each
  parameter disjoint, covering it exactly, each holding its rows of the full tensor.

Replicas that apply the same ops to the same averaged gradients are bitwise equal, so any
difference at all is a fault. Each rank is seeded differently before the model is built
(unless `same_init`), so a wrapper that does not broadcast at construction fails the first
audit. The run goes on past a finding: the tensors that differ are resynchronized from rank 0,
so the next audit shows the next bug rather than the echo of the first, and every distinct
finding is reported with its phase, tensor and first step.

Consistency proves agreement, not correctness: a wrapper that sums without dividing keeps every
rank identical and wrong. Equivalence against a single process is the check for that.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from verify.checks import verdict
from verify.checks.audit import Checkpoint, ModelAudit, TensorDiff, measured, unique_names
from verify.checks.failures import failure_findings
from verify.checks.layout import layout_problems
from verify.checks.options import CheckOptions
from verify.checks.sanitizing import training
from verify.checks.verdict import FAULT, Finding, Refusal, Verdicted, collapse, verdict_of
from verify.hints import kinds
from verify.hints.table import situation_of, with_hints
from verify.launching import Raised, RankContext
from verify.options import knob
from verify.replica_audit.fingerprint import fingerprints
from verify.replica_audit.group import comm_device
from verify.replica_audit.stillness import Stillness, nothing_trained
from verify.training.hooks import Hooks, Progress
from verify.training.interface import InterfaceError
from verify.training.sharded import full_gradients, full_state
from verify.training.trainer import Trainer, TrainSpec

NO_BROADCAST = (
    "parameters were not broadcast from rank 0 (if the design seeds every rank alike instead, "
    "run with --same-init)"
)


NO_BUFFER_BROADCAST = (
    "buffers were not broadcast from rank 0 at construction (PyTorch's DDP broadcasts them "
    "there, and before every forward with broadcast_buffers=True)"
)


@dataclass(frozen=True, kw_only=True)
class ConsistencyOptions(CheckOptions):
    command: str = knob("consistency", cli=False)


@dataclass(frozen=True)
class ConsistencyReport:
    """What one rank found (every rank finds the same: audits are collectives)."""

    checkpoints: tuple[Checkpoint, ...] = ()
    mismatches: tuple[TensorDiff, ...] = ()
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()
    untrained: str = ""  # nothing trained, in words (`AuditHooks.untrained`); "" if it did


@dataclass(frozen=True)
class ConsistencyResult(Verdicted):
    """The verdict, every checkpoint audited, and every distinct finding."""

    options: ConsistencyOptions
    verdict: str
    checkpoints: tuple[Checkpoint, ...] = ()
    mismatches: tuple[TensorDiff, ...] = ()
    findings: tuple[Finding, ...] = ()
    failure: str | None = None  # a rank raised, crashed, hung or timed out: the launcher's words
    elapsed_s: float = 0.0
    notes: tuple[str, ...] = field(default=())
    threads: str = ""
    # a failed run's diagnosis and raise as typed findings, with their hints (`failures.py`)
    failure_findings: tuple[Finding, ...] = ()
    untrained: str = ""  # nothing trained, in words (a note too); "" when training moved

    @property
    def headline(self) -> str:
        if self.passed:
            ranks, n = verdict.every_rank(self.options.world_size), len(self.checkpoints)
            empty = ", but nothing trained (see the note)" if self.untrained else ""
            return f"PASS: replicas bitwise identical on {ranks} at all {n} checkpoints{empty}"
        if self.findings:
            more = len(self.findings) - 1
            tail = f" (and {more} more distinct finding{'s' if more > 1 else ''})" if more else ""
            return f"FAULT: {self.findings[0].describe()}{tail}"
        if self.verdict == FAULT:
            return f"FAULT: {self.failure.splitlines()[0]}"
        return f"TIMEOUT: {self.failure.splitlines()[0]}"

    def to_dict(self) -> dict:
        doc = {"check": "consistency", **asdict(self), "passed": self.passed,
               "headline": self.headline}  # fmt: skip
        doc["mismatches"] = [m.as_checkpoint_dict() for m in self.mismatches]
        return doc


def check_consistency(options: ConsistencyOptions) -> ConsistencyResult:
    """Run the consistency check; a failing rank or a hang comes back as a failed result."""
    start = time.perf_counter()
    run, reports, raised = verdict.run_check(consistency_on_rank, options)
    report = reports[0] if reports else ConsistencyReport()
    situation = situation_of(options)
    findings = with_hints(collapse([*raised, *(f for r in reports for f in r.findings)]), situation)
    notes = tuple(dict.fromkeys(n for r in reports for n in r.notes)) + run.notes
    return ConsistencyResult(
        options,
        verdict_of(findings, run),
        checkpoints=report.checkpoints,
        mismatches=report.mismatches,
        findings=findings,
        failure=verdict.failure_text(run),
        elapsed_s=time.perf_counter() - start,
        notes=notes,
        threads=run.threads,
        failure_findings=failure_findings(run, situation),
        untrained=report.untrained,
    )


def run_consistency_on_rank(
    ctx: RankContext, spec: TrainSpec, sanitize: bool = False
) -> ConsistencyReport | Refusal:
    """The check as one rank runs it, inside an already launched job: a collective, every
    rank returns the same report. Training that raises raises here."""
    return Raised.unwrap(consistency_on_rank(ctx, spec, sanitize))


def consistency_on_rank(
    ctx: RankContext, spec: TrainSpec, sanitize: bool = False
) -> ConsistencyReport | Refusal | Raised:
    """`run_consistency_on_rank` as `check_consistency` launches it: training that raised
    comes back as a `Raised` carrying the report of what was audited before (the launcher
    reports the rank as failed, with that report as its partial value)."""
    audit = AuditHooks()
    guard = None
    try:
        hooks = [audit, Progress(f"consistency {spec.impl} on {spec.workload}")]
        with training(ctx, spec, hooks, sanitize=sanitize) as (trainer, guard):
            trainer.run()
    except InterfaceError as exc:
        return Refusal.of(exc, ctx.rank)
    except Exception as exc:  # the launcher reports it, with what was found before it
        return Raised(exc, audit.report(guard))
    return audit.report(guard)


class AuditHooks(Hooks):
    """Audits at every checkpoint and resynchronizes what differs (module docstring)."""

    def __init__(self) -> None:
        self.checkpoints: list[Checkpoint] = []
        self.mismatches: list[TensorDiff] = []
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self._layouts: set[tuple[str, str]] = set()  # layout problems found (not found again)
        self.still = Stillness()  # did the class train anything? (`untrained`)

    def after_build(self, run: Trainer) -> None:
        # A wrapper with full_parameters() shards the parameters, so their optimizer state too.
        sharded = run.impl is not None and run.impl.sharded
        sharded = sharded or hasattr(run.wrapped, "full_parameters")
        self.auditor = ModelAudit(run.model, None if sharded else run.optimizer)
        # parameters no hook fires for: a bucket planned over one never fills (hint_rules.py)
        self.frozen = sum(not p.requires_grad for p in run.model.parameters())
        if sharded:
            self.notes.append(
                "optimizer state is sharded: audited parameters, buffers and gradients"
            )
        if run.spec.same_init:
            self.notes.append("--same-init: every rank built the model from the same seed")
        state = full_state(self.auditor.state_tensors(), run.model, run.wrapped)
        self._follow(state)
        self._layout(run, "construction", 0, "construction", state)
        found = self._audit("construction", 0, "construction", state)
        hint = (
            NO_BROADCAST if any(m.name.startswith("param:") for m in found)
            else NO_BUFFER_BROADCAST if any(m.name.startswith("buffer:") for m in found)
            else None
        )  # fmt: skip
        if hint:
            last = self.findings[-1]
            self.findings[-1] = replace(last, message=f"{last.message}: {hint}")
            buffers_only = hint is NO_BUFFER_BROADCAST
            self.findings[-1] = replace(
                self.findings[-1], kind=kinds.NOT_BROADCAST, numbers={"buffers_only": buffers_only}
            )

    def after_sync(self, run: Trainer, step: int) -> None:
        # Full gradients: a sharded class's put together from the shards (training/sharded.py).
        grads = full_gradients(run.model, run.wrapped)
        named = [(f"grad:{name}", grad) for name, grad in grads.items()]
        self._audit(f"step {step} gradients", step, "gradients", named)
        self.still.gradients(grads.values())

    def after_step(self, run: Trainer, step: int) -> None:
        if self.auditor.optimizer is not None:
            self.auditor.optimizer = run.optimizer
        state = full_state(self.auditor.state_tensors(), run.model, run.wrapped)
        if step == 1:  # once trained: the layout a step leaves (construction's is checked too)
            self._layout(run, f"step {step}", step, "step", state)
        self._audit(f"step {step}", step, "step", state)
        self._follow(state)

    def after_load(self, run: Trainer, step: int, error: Exception | None) -> None:
        if error is not None:
            message = f"step {step} state_dict round trip: {error} (training went on from a fresh optimizer)"
            numbers = {"exception": type(error).__name__}
            self.findings.append(Finding("consistency", "checkpoint", step, message,
                                         kind=kinds.ROUND_TRIP_RAISED, numbers=numbers))  # fmt: skip
        elif run.round_trip is not None and run.round_trip.note:
            self.notes.append(
                f"optimizer state_dict round trip after step {step}: {run.round_trip.note}"
            )
        self.auditor.follow(run.model, run.optimizer)  # a model round trip built fresh ones
        label = f"step {step} after the state_dict round trip"
        state = full_state(self.auditor.state_tensors(), run.model, run.wrapped)
        self._audit(label, step, "checkpoint", state)

    def _follow(self, state) -> None:
        """The parameters' fingerprints to `self.still`, until one has changed (a run that
        trains fingerprints its parameters twice here: at construction and after step 1)."""
        if self.still.moved:
            return
        params = [(n, t) for n, t in state if n.startswith("param:") and t is not None]
        prints = fingerprints([t for _, t in params])
        self.still.parameters({n: p for (n, _), p in zip(params, prints)})

    @property
    def untrained(self) -> str:
        """Nothing trained, in words ("" when it did): the class's gradients after their
        synchronization, and its parameters after each step. The tool's own loss trains the
        model, so what stands still is the class's doing."""
        s = self.still
        why = (
            "(the class left every gradient zero or None after synchronizing them: "
            "equivalence against one process would fail)"
            if s.zero_gradients
            else "(the class's step never reaches the parameters: equivalence against one "
            "process would fail)"
        )
        return nothing_trained(s.zero_gradients, s.unchanged, why=why)

    def _layout(self, run: Trainer, label: str, step: int, phase: str, state) -> None:
        """The shard layout check (layout.py) on the full parameters in `state`."""
        full = {
            k.removeprefix("param:"): t
            for k, t in state
            if k.startswith("param:") and t is not None
        }
        checked, found = layout_problems(run.model, run.wrapped, full, self.auditor.process_group)
        if checked and step == 0:
            self.notes.append(
                f"shard layout: {checked} parameters sharded by rows, checked at construction "
                "and after step 1 (disjoint, covering, each shard its rows of the full tensor)"
            )
        found = [p for p in found if (p.kind, p.message) not in self._layouts]  # said already
        self._layouts |= {(p.kind, p.message) for p in found}
        for kind in dict.fromkeys(p.kind for p in found):  # one finding a kind: the first, and
            same = [p for p in found if p.kind == kind]  # how many more tensors show it
            more = f" (and {len(same) - 1} more tensors there)" if len(same) > 1 else ""
            ranks = tuple(sorted({r for p in same for r in p.ranks}))
            message = f"{label}: {same[0].message}{more}"
            self.findings.append(Finding("consistency", phase, step, message, same[0].tensor,
                                         ranks, kind=kinds.LAYOUT, numbers={"problem": kind}))  # fmt: skip

    def _audit(self, label: str, step: int, phase: str, named) -> list[TensorDiff]:
        checkpoint, found = self.auditor.audit(label, named, step=step, phase=phase)
        self.checkpoints.append(checkpoint)
        self.mismatches.extend(found)
        if found:  # one finding per checkpoint: the first tensor, and how many more
            more = f" (and {len(found) - 1} more tensors there)" if len(found) > 1 else ""
            tensor = found[0].name.split(":", 1)[-1]
            message = found[0].line() + more
            kind, numbers = measured(found, phase, step)
            if phase == "gradients":
                numbers["frozen"] = self.frozen
            self.findings.append(Finding("consistency", phase, step, message, tensor,
                                         _ranks(found), kind=kind, numbers=numbers))  # fmt: skip
            _resync(dict(unique_names(named)), found, self.auditor.process_group)
        return found

    def report(self, sanitize=None) -> ConsistencyReport:
        """What this rank found, with the race sanitizer's findings and notes when it ran."""
        findings, notes = list(self.findings), list(self.notes)
        if sanitize is not None:
            findings += sanitize.findings
            notes += sanitize.notes
        if self.untrained:
            notes.append(self.untrained)
        return ConsistencyReport(
            tuple(self.checkpoints),
            tuple(self.mismatches),
            tuple(findings),
            tuple(notes),
            self.untrained,
        )


def _resync(named: dict, found: list[TensorDiff], group) -> None:
    """Broadcast, in place, every differing tensor from rank 0, so later audits find new
    faults rather than this one again. Missing tensors (a None gradient) and tensors whose
    shape or dtype differ cannot be broadcast; every rank skips the same ones. A tensor off
    the group's device (AdamW's `step` lives on the CPU; NCCL moves CUDA tensors only)
    travels as a copy on it."""
    device = comm_device(group)
    for m in found:
        tensor = named.get(m.name)
        if tensor is None or m.detail:
            continue
        with torch.no_grad():
            data = tensor.data
            staged = data.to(device)  # `data` itself when it is there already
            dist.broadcast(staged, src=dist.get_global_rank(group, 0), group=group)
            if staged is not data:
                data.copy_(staged)


def _ranks(found: list[TensorDiff]) -> tuple[int, ...]:
    return tuple(sorted({r for m in found for r in m.ranks}))


__all__ = ["ConsistencyOptions", "ConsistencyResult", "check_consistency"]
