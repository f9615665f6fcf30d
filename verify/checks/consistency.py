"""The consistency check: do all replicas hold bitwise identical state at every step?

Trains an implementation for a few steps on a workload and audits (`audit.py`) right after
construction, after every gradient synchronization, and after every optimizer step:

- parameters and buffers: always;
- gradients: after `finish_gradient_synchronization()` (or the backward of wrappers that
  synchronize inside backward), where every rank must hold the same averaged gradient;
- optimizer state: for replicated optimizers only (a sharded optimizer keeps different state
  per rank by design).

Replicas that apply the same ops to the same averaged gradients are bitwise equal, so any
difference at all is a fault, and the first checkpoint where one appears says where to look.
Each rank is seeded differently before the model is built, so a wrapper that does not
broadcast parameters and buffers at construction fails the first audit.

Consistency proves agreement, not correctness: a wrapper that sums without dividing keeps every
rank identical and wrong. Equivalence against a single process is the check for that.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from impls.registry import DEFAULT_BUCKET_MB, resolve
from verify.checks.audit import Auditor, Checkpoint, Mismatch
from verify.launching import RankContext, launch
from verify.training.workloads import get_workload


@dataclass(frozen=True, kw_only=True)
class ConsistencyOptions:
    """What to run; validated on construction so bad input fails before any rank starts."""

    impl: str
    world_size: int = 2
    steps: int = 3
    workload: str = "mlp"
    bucket_mb: float = DEFAULT_BUCKET_MB
    model_size_m: float | None = None  # transformer only: millions of parameters
    lr: float = 1e-3
    seed: int = 0
    timeout_s: float = 120.0
    backend: str = "gloo"  # "nccl": one GPU per rank

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket size must be > 0 MB, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        if self.backend == "nccl" and torch.cuda.device_count() < self.world_size:
            raise ValueError(
                f"backend nccl needs one GPU per rank: world size {self.world_size}, "
                f"{torch.cuda.device_count()} GPU(s) visible"
            )
        resolve(self.impl)  # raises ImplError (a ValueError) naming the problem
        get_workload(self.workload)


@dataclass(frozen=True)
class ConsistencyResult:
    """The verdict, every checkpoint audited, and the mismatches found (empty on a pass)."""

    options: ConsistencyOptions
    passed: bool
    checkpoints: tuple[Checkpoint, ...] = ()
    mismatches: tuple[Mismatch, ...] = ()
    failure: str | None = None  # a rank raised, crashed or timed out: the launcher's summary
    elapsed_s: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def verdict(self) -> str:
        if self.passed:
            n = len(self.checkpoints)
            return (
                f"PASS: replicas bitwise identical on all {self.options.world_size} ranks at "
                f"all {n} checkpoints"
            )
        if self.failure:
            return f"FAULT: {self.failure.splitlines()[0]}"
        return f"FAULT: {self.mismatches[0].describe()}"

    def to_dict(self) -> dict:
        return {"check": "consistency", "verdict": self.verdict, **asdict(self)}


def check_consistency(options: ConsistencyOptions) -> ConsistencyResult:
    """Run the consistency check; a failing rank or a hang comes back as a failed result."""
    start = time.perf_counter()
    run = launch(
        run_consistency_on_rank,
        world_size=options.world_size,
        args=(options,),
        timeout_s=options.timeout_s,
        backend=options.backend,
    )
    elapsed = time.perf_counter() - start
    if not run.ok:
        return ConsistencyResult(options, False, failure=run.summary(), elapsed_s=elapsed)
    checkpoints, mismatches, notes = run.values[0]
    return ConsistencyResult(
        options, not mismatches, tuple(checkpoints), tuple(mismatches), None, elapsed, tuple(notes)
    )


def run_consistency_on_rank(
    ctx: RankContext, options: ConsistencyOptions
) -> tuple[list[Checkpoint], list[Mismatch], list[str]]:
    """The check as one rank runs it, inside an already launched job (the certification
    matrix runs many of these in one launch). Every rank returns the same answer."""
    impl = resolve(options.impl)
    workload = get_workload(options.workload, seed=options.seed, size_m=options.model_size_m)
    # Different on purpose: replicas only agree if the wrapper broadcasts at construction.
    torch.manual_seed(options.seed * 1000 + ctx.rank)
    model = workload.build().to(ctx.device)
    wrapped = impl.wrap(
        model,
        bucket_size_mb=options.bucket_mb,
        find_unused_parameters=workload.has_unused_parameters,
    )
    optimizer = impl.make_optimizer(workload.param_groups(model, lr=options.lr), torch.optim.AdamW)
    auditor = Auditor(model, None if impl.sharded else optimizer)
    checkpoints: list[Checkpoint] = []
    mismatches: list[Mismatch] = []

    def audit(label, named):
        checkpoint, found = auditor.audit(label, named)
        checkpoints.append(checkpoint)
        mismatches.extend(found)
        return not found

    notes = []
    if impl.sharded:
        notes.append("optimizer state is sharded: audited parameters, buffers and gradients")
    finish = getattr(wrapped, "finish_gradient_synchronization", None)
    start_batch = getattr(wrapped, "on_train_batch_start", None)
    ok = audit("construction", auditor.state_tensors())
    for step in range(1, options.steps + 1):
        if not ok:
            break
        if start_batch is not None:
            start_batch()
        optimizer.zero_grad()
        batch = workload.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
        workload.loss(wrapped, batch.to(ctx.device)).backward()
        if finish is not None:
            finish()
        ok = audit(f"step {step} gradients", auditor.grad_tensors())
        if not ok:
            break
        optimizer.step()
        ok = audit(f"step {step}", auditor.state_tensors())
    return checkpoints, mismatches, notes
