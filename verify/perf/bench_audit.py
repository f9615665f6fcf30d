"""Benchmark: what the per-step audit costs, against the alternatives, measured side by side.

In one launch, on the transformer workload (~50M parameters by default), each repeat times, in
turn:

- one training step (zero_grad, forward, backward, gradient sync, AdamW step);
- the audit of that step (gradients after sync + parameters, buffers and optimizer state
  after the step), exactly what `consistency` runs;
- an all-gather of every tensor the audit covers: the naive way to compare replicas, and a
  lower bound on its cost (it does not even compare yet).

Kinds are interleaved within each repeat so machine noise hits all three alike; the report
gives medians (and minimums) and the two ratios the project holds itself to: audit / all-gather
at most 0.1, audit / step under 0.05. Every time is the slowest rank's (the step is as slow as
its slowest rank).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from tabulate import tabulate

from impls.registry import resolve
from verify.checks.audit import Auditor
from verify.launching import RankContext, launch
from verify.training.workloads import get_workload

GOAL_VS_ALLGATHER = 0.10
GOAL_VS_STEP = 0.05


@dataclass(frozen=True, kw_only=True)
class AuditBenchOptions:
    impl: str = "bucketed"
    world_size: int = 2
    model_size_m: float = 50.0
    repeats: int = 5
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(
                f"world size must be >= 2 to audit across ranks, got {self.world_size}"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        resolve(self.impl)


@dataclass(frozen=True)
class AuditBenchResult:
    options: AuditBenchOptions
    ok: bool
    parameters: int = 0
    audited_tensors: int = 0
    audited_bytes: int = 0
    step_s: tuple[float, ...] = ()
    audit_s: tuple[float, ...] = ()
    allgather_s: tuple[float, ...] = ()
    machine: str = ""
    torch_version: str = ""
    failure: str | None = None

    @property
    def audit_vs_allgather(self) -> float:
        return statistics.median(self.audit_s) / statistics.median(self.allgather_s)

    @property
    def audit_vs_step(self) -> float:
        return statistics.median(self.audit_s) / statistics.median(self.step_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.ok:
            d["audit_vs_allgather"] = self.audit_vs_allgather
            d["audit_vs_step"] = self.audit_vs_step
        return d


def run_audit_bench(options: AuditBenchOptions) -> AuditBenchResult:
    run = launch(
        _rank_main, world_size=options.world_size, args=(options,), timeout_s=options.timeout_s
    )
    if not run.ok:
        return AuditBenchResult(options, False, failure=run.summary())
    return AuditBenchResult(options, True, **run.values[0])


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def _rank_main(ctx: RankContext, options: AuditBenchOptions) -> dict:
    impl = resolve(options.impl)
    workload = get_workload("transformer", size_m=options.model_size_m)
    torch.manual_seed(ctx.rank)
    model = workload.build()
    wrapped = impl.wrap(model)
    optimizer = impl.make_optimizer(workload.param_groups(model), torch.optim.AdamW)
    auditor = Auditor(model, None if impl.sharded else optimizer)
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    step_no = 0

    def train_step():
        nonlocal step_no
        step_no += 1
        optimizer.zero_grad()
        batch = workload.batch(step_no, ctx.world_size).shard(ctx.rank, ctx.world_size)
        workload.loss(wrapped, batch).backward()
        finish()
        optimizer.step()

    def covered():
        return auditor.grad_tensors() + auditor.state_tensors()

    def audit():
        auditor.audit("grads", auditor.grad_tensors())
        auditor.audit("state", auditor.state_tensors())

    def allgather():
        for _, t in covered():
            if t is not None:
                out = [torch.empty_like(t) for _ in range(ctx.world_size)]
                dist.all_gather(out, t.detach().contiguous())

    train_step()  # warm-up: allocates gradients and optimizer state
    audit()
    steps, audits, gathers = [], [], []
    for _ in range(options.repeats):
        steps.append(_timed(train_step))
        audits.append(_timed(audit))
        gathers.append(_timed(allgather))
    tensors = [t for _, t in covered() if t is not None]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "audited_tensors": len(tensors),
        "audited_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "step_s": tuple(steps),
        "audit_s": tuple(audits),
        "allgather_s": tuple(gathers),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads/rank, "
        f"{platform.node()}",
        "torch_version": torch.__version__,
    }


def format_audit_bench(result: AuditBenchResult) -> str:
    o = result.options
    if not result.ok:
        return f"bench-audit failed:\n{result.failure}"
    head = (
        f"audit benchmark: {o.impl} on a {result.parameters / 1e6:.1f}M-parameter transformer, "
        f"world size {o.world_size}, {o.repeats} interleaved repeats\n"
        f"audited per step: {result.audited_tensors} tensors, "
        f"{result.audited_bytes / 2**20:.0f} MiB per rank  (torch {result.torch_version}; "
        f"{result.machine})\n"
    )
    rows = [
        [name, f"{statistics.median(v) * 1e3:.1f}", f"{min(v) * 1e3:.1f}"]
        for name, v in [
            ("training step", result.step_s),
            ("audit (fingerprints)", result.audit_s),
            ("all-gather of every tensor", result.allgather_s),
        ]
    ]
    table = tabulate(rows, headers=["what", "median ms", "min ms"])
    a, s = result.audit_vs_allgather, result.audit_vs_step
    verdicts = (
        f"audit / all-gather: {a:.4f}  (goal <= {GOAL_VS_ALLGATHER}: "
        f"{'met' if a <= GOAL_VS_ALLGATHER else 'MISSED'})\n"
        f"audit / step:       {s:.4f}  (goal < {GOAL_VS_STEP}: "
        f"{'met' if s < GOAL_VS_STEP else 'MISSED'})"
    )
    return f"{head}\n{table}\n\n{verdicts}"
