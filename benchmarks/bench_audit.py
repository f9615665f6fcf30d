"""`python benchmarks/audit_cost.py` (a maintainer's script): what the per-step audit costs,
against the alternatives.

In one launch, on the transformer workload (~50M parameters by default), three arms take
turns every round, the order rotating (the skeleton of `costs.py`):

- one training step of the one trainer (`training/trainer.py`: zero_grad, forward, backward,
  gradient sync, AdamW step);
- the audit of that state (gradients after sync, then parameters, buffers and optimizer
  state), exactly what `consistency` runs (`checks/audit.py`);
- an all-gather of every tensor the audit covers: the naive way to compare replicas, and a
  lower bound on its cost (it does not even compare yet).

Every time is the slowest rank's. The two ratios the tool holds itself to, audit /
all-gather at most 0.1 and audit / step under 0.05, are paired per round with a 95% interval
and decided three ways (`timing.decide`).

`--script-audit` measures instead what `audit --nproc N -- train.py` adds to a training step
(audited / plain, goal at most 1.02: `bench_script_audit.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from benchmarks.bench_script_audit import GOAL as GOAL_SCRIPT
from benchmarks.bench_script_audit import script_audit_bench_on_rank
from benchmarks.costs import CostOptions, goal_bar, run_cost, take_turns
from verify.checks.audit import ModelAudit
from verify.launching import RankContext
from verify.options import knob
from verify.perf.base import Measured, model_size, next_step, parameters
from verify.perf.timing import Ratio, timed
from verify.training.trainer import Trainer, TrainSpec, spec_from

GOAL_VS_ALLGATHER = 0.10
GOAL_VS_STEP = 0.05


@dataclass(frozen=True, kw_only=True)
class AuditBenchOptions(CostOptions):
    """What the audit is measured on, and how many rounds."""

    world_size: int = knob(2, "ranks to start (the audit compares ranks: at least 2)", minimum=2)
    model_size_m: float = model_size(50.0)
    local_batch: int = knob(4, "sequences per rank and step", minimum=1)
    repeats: int = knob(5, "interleaved rounds: a step, an audit, an all-gather each", minimum=1)
    script_audit: bool = knob(
        False, "measure `audit --nproc`'s step hooks instead: audited / plain training step"
    )

    command: ClassVar[str] = "bench-audit"
    # Each rank seeded differently (TrainSpec's default): the wrapper's broadcast makes
    # replicas agree, as in `consistency`.
    same_init: ClassVar[bool] = False

    def train_spec(self) -> TrainSpec:
        return spec_from(self, steps=1 + self.repeats)


@dataclass(frozen=True)
class AuditBenchResult(Measured):
    """Every round's three times, and what the audit covered."""

    options: AuditBenchOptions
    verdict: str
    parameters: int = 0
    audited_tensors: int = 0
    audited_bytes: int = 0
    step_s: tuple[float, ...] = ()
    audit_s: tuple[float, ...] = ()
    allgather_s: tuple[float, ...] = ()
    plain_s: tuple[float, ...] = ()  # --script-audit: steps without the hooks
    audited_s: tuple[float, ...] = ()  # --script-audit: steps with them
    findings: int = 0  # --script-audit: findings of the audit (0: replicas identical)
    audit_s_per_step: float = 0.0  # --script-audit: time inside the hooks, a step (rank 0)
    machine: str = ""
    torch_version: str = ""
    failure: str | None = None

    def bars(self) -> list[tuple[str, Ratio, float, str]]:
        """(what, ratio paired per round, goal, decision) for both goals (for the one goal of
        --script-audit)."""
        if self.options.script_audit:
            return [goal_bar("audited / plain step", self.audited_s, self.plain_s, GOAL_SCRIPT)]
        return [
            goal_bar("audit / all-gather", self.audit_s, self.allgather_s, GOAL_VS_ALLGATHER),
            goal_bar("audit / step", self.audit_s, self.step_s, GOAL_VS_STEP),
        ]

    @property
    def audit_vs_allgather(self) -> float:
        return self.bars()[0][1].value

    @property
    def audit_vs_step(self) -> float:
        return self.bars()[1][1].value

    def to_dict(self) -> dict:
        d = {**asdict(self), "ok": self.ok}
        if self.ok and not self.options.script_audit:
            d["audit_vs_allgather"] = self.audit_vs_allgather
            d["audit_vs_step"] = self.audit_vs_step
        if self.ok:
            d["bars"] = [
                {"what": w, **r.to_dict(), "goal": g, "decision": dec}
                for w, r, g, dec in self.bars()
            ]
        return d


def run_audit_bench(options: AuditBenchOptions) -> AuditBenchResult:
    on_rank = script_audit_bench_on_rank if options.script_audit else audit_bench_on_rank
    return run_cost(options, on_rank, AuditBenchResult)


def audit_bench_on_rank(ctx: RankContext, options: AuditBenchOptions) -> dict:
    """The three arms (module docstring), after a warm-up step and audit."""
    trainer = Trainer(ctx, options.train_spec())
    sharded = trainer.impl is not None and trainer.impl.sharded
    auditor = ModelAudit(trainer.model, None if sharded else trainer.optimizer)

    def covered():
        return auditor.grad_tensors() + auditor.state_tensors()

    def audit() -> None:
        auditor.audit("grads", auditor.grad_tensors())
        auditor.audit("state", auditor.state_tensors())

    def allgather() -> None:
        for _, t in covered():
            if t is not None:
                t = t.detach().to(ctx.device).contiguous()  # optimizer `step` may be a CPU scalar
                dist.all_gather([torch.empty_like(t) for _ in range(ctx.world_size)], t)

    trainer.step(1)  # warm-up: allocates gradients and optimizer state
    audit()
    arms = {
        "step": lambda: timed(lambda: next_step(trainer), ctx.device),
        "audit": lambda: timed(audit, ctx.device),
        "allgather": lambda: timed(allgather, ctx.device),
    }
    samples = take_turns(ctx, arms, options.repeats, "bench-audit")
    tensors = [t for _, t in covered() if t is not None]
    return {
        "parameters": parameters(trainer.model),
        "audited_tensors": len(tensors),
        "audited_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "step_s": tuple(samples["step"]),
        "audit_s": tuple(samples["audit"]),
        "allgather_s": tuple(samples["allgather"]),
    }
