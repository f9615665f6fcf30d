"""One cell of the certification matrix, as one rank runs it: an implementation trained under
one behaviour, judged by one check.

A *behaviour* (`Behaviour`) is a training situation an implementation must get right: a world
size, a workload, a bucket size, gradient accumulation under `no_sync()`,
`zero_grad(set_to_none=False)`, an LR scheduler, an optimizer `state_dict()` round trip, a
parameter group added after construction. Its training loop is the equivalence check's
(`equivalence.py`), knob for knob, so the two checks judge the same run:

- *equivalence*: `run_equivalence_on_rank` with the behaviour's options;
- *consistency*: the same loop, audited as `consistency.py` audits (`audit.Auditor`: bitwise
  equal on every rank after construction, after every gradient synchronization and after
  every optimizer step), here with the knobs `consistency.py` does not take;
- *shard* (sharded optimizers): after training, each rank's optimizer-state bytes against
  the unsharded optimizer's (see `check_shard_sizes`).

`add_param_group` is played through the implementation itself (`with_group_added_later`): its
optimizer is built over the first parameter group and gets the others through
`add_param_group()` right after construction, so both checks run it unchanged.

Cells follow each other in one process (`matrix.py` runs many per launch): each builds what
it uses, seeds explicitly and restores torch's random state on return.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from impls.registry import DEFAULT_BUCKET_MB, Implementation, resolve
from impls.registry import takes_bucket_size as _bucket_keyword
from verify.checks.audit import Auditor
from verify.checks.equivalence import (
    SCHEDULER_GAMMA,
    EquivalenceOptions,
    full_state_dict,
    run_equivalence_on_rank,
)
from verify.launching import RankContext
from verify.training.workloads import get_workload

CHECKS = ("consistency", "equivalence", "shard")
ADDED_LATER = "+add_param_group"  # suffix of an implementation played through add_param_group


@dataclass(frozen=True, kw_only=True)
class Behaviour:
    """A row of the certification matrix: one training situation.

    Attributes:
        key: short name (`--rows`, and `shows_on` of the faulty catalogue).
        title: what the row says in the table.
        world_size, workload, steps: as in the checks' options.
        bucket_mb: None runs the default bucket size and claims nothing about buckets; a
            value makes the row a bucket-size behaviour, claimed only by wrappers that take
            `bucket_size_mb` (and PyTorch DDP's `bucket_cap_mb`).
        accumulate: micro-batches per step, all but the last under `no_sync()` (claimed only
            by wrappers that have `no_sync()`).
        set_to_none, scheduler, round_trip: as in `EquivalenceOptions`.
        add_param_group: build the optimizer over the first group and add the others.
        sharded_only: a behaviour of the sharded optimizer: n/a for DDP wrappers.
    """

    key: str
    title: str
    world_size: int = 2
    workload: str = "mlp"
    steps: int = 3
    bucket_mb: float | None = None
    accumulate: int = 1
    set_to_none: bool = True
    scheduler: bool = False
    round_trip: bool = False
    add_param_group: bool = False
    sharded_only: bool = False

    def __post_init__(self) -> None:
        if self.round_trip and self.steps < 2:
            raise ValueError(f"{self.key}: a state_dict round trip needs steps >= 2")
        get_workload(self.workload)


@dataclass(frozen=True)
class CheckResult:
    """How one check went on one cell.

    `status` is "pass", "fail" (the check found a fault: wrong result, desync, a rank that
    raised, crashed or hung), "not claimed" (the implementation does not offer what the
    behaviour needs: no `no_sync()`, no `bucket_size_mb`) or "n/a" (the check or the behaviour
    does not apply: a shard check for a DDP wrapper, a sharded-optimizer row for one).
    `detail` says why: the first divergence, the launcher's diagnosis of a failed run (several
    lines), or what is not claimed; `headline` is its one-line form.
    """

    status: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    @property
    def headline(self) -> str:
        """The most telling line of `detail`: for a launch that failed, the collective trace's
        diagnosis when it has one (it names the mismatch), else the first line."""
        lines = self.detail.splitlines() or [""]
        traced = [line for line in lines if line.startswith(_TRACE_SAYS)]
        return traced[0].removeprefix(_TRACE_SAYS).strip() if traced else lines[0]


_TRACE_SAYS = "collective trace says:"  # how LaunchResult.summary() cites the diagnosis


# --- the implementation a behaviour runs ---------------------------------------------------


def implementation_for(impl_name: str, behaviour: Behaviour) -> str | Implementation:
    """What the checks run for this behaviour: the registered name, or for add_param_group the
    implementation derived from it (named `<name>+add_param_group`; `resolve` returns an
    Implementation as is, so it flows wherever the name did)."""
    if not behaviour.add_param_group:
        return impl_name
    return with_group_added_later(resolve(impl_name), impl_name + ADDED_LATER)


def with_group_added_later(impl: Implementation, name: str) -> Implementation:
    """`impl` whose optimizer is built over the first parameter group only, the others added
    with `add_param_group()` right after construction (a collective for sharded ones)."""
    if not impl.sharded:
        raise ValueError(f"{impl.name}: add_param_group is a sharded-optimizer behaviour")

    def sharded(params, optimizer_cls, *, process_group=None, **defaults):
        first, *rest = list(params)
        optimizer = impl.make_optimizer(
            [first], optimizer_cls, process_group=process_group, **defaults
        )
        for group in rest:
            optimizer.add_param_group(group)
        return optimizer

    return replace(impl, name=name, sharded_optimizer=sharded)


def not_applicable(impl: Implementation, behaviour: Behaviour, check: str) -> str | None:
    """Why this check or behaviour does not apply to `impl` at all, or None if it does."""
    if behaviour.sharded_only and not impl.sharded:
        return "sharded optimizers only"
    if check == "shard" and not impl.sharded:
        return "not a sharded optimizer"
    if check == "shard" and behaviour.world_size == 1:
        return "one rank: nothing to shard"
    return None


def not_claimed(wrapped: nn.Module, behaviour: Behaviour) -> str | None:
    """Why the wrapper does not claim this behaviour, or None if it does."""
    if behaviour.accumulate > 1 and not hasattr(wrapped, "no_sync"):
        return "gradient accumulation: the wrapper has no no_sync()"
    if behaviour.bucket_mb is not None and not takes_bucket_size(type(wrapped)):
        return "bucket sizes: the wrapper takes no bucket_size_mb"
    return None


def takes_bucket_size(cls: type) -> bool:
    """A constructor with `bucket_size_mb` (the assignment interface) or `bucket_cap_mb`
    (PyTorch DDP's), as `impls.recipes.from_class` decides."""
    return _bucket_keyword(cls) is not None


# --- the checks ----------------------------------------------------------------------------


def run_check_on_rank(
    ctx: RankContext, impl_name: str, behaviour: Behaviour, check: str
) -> CheckResult:
    """Run one check of one cell on this rank (a collective: every rank, same arguments).
    Every rank returns the same result."""
    why = not_applicable(resolve(impl_name), behaviour, check)
    if why:
        return CheckResult("n/a", why)
    run = {"consistency": _consistency, "equivalence": _equivalence, "shard": _shard}[check]
    devices = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return run(ctx, implementation_for(impl_name, behaviour), behaviour)


def _equivalence(ctx: RankContext, impl_name: str, b: Behaviour) -> CheckResult:
    # The claim is the wrapper's, decided on the built wrapper as the other checks decide it.
    reason = not_claimed(_Training(ctx, impl_name, b).wrapped, b)
    if reason:
        return CheckResult("not claimed", reason)
    report = run_equivalence_on_rank(ctx, equivalence_options(impl_name, b))
    if report.unsupported:
        return CheckResult("not claimed", report.unsupported)
    return CheckResult("pass" if report.passed else "fail", report.describe())


def equivalence_options(impl_name: str, b: Behaviour) -> EquivalenceOptions:
    return EquivalenceOptions(
        impl=impl_name,
        world_size=b.world_size,
        steps=b.steps,
        workload=b.workload,
        bucket_mb=b.bucket_mb or DEFAULT_BUCKET_MB,
        accumulate=b.accumulate,
        set_to_none=b.set_to_none,
        scheduler=b.scheduler,
        round_trip=b.round_trip,
    )


def _consistency(ctx: RankContext, impl_name: str, b: Behaviour) -> CheckResult:
    training = _Training(ctx, impl_name, b)
    reason = not_claimed(training.wrapped, b)
    if reason:
        return CheckResult("not claimed", reason)
    auditor = Auditor(training.model, None if training.impl.sharded else training.optimizer)
    audits = 0

    def audit(label: str, named) -> None:
        nonlocal audits
        _, found = auditor.audit(label, named)
        audits += 1
        if found:
            more = f" (and {len(found) - 1} more tensors)" if len(found) > 1 else ""
            raise _Mismatch(found[0].describe() + more)

    def after_step(step: int) -> None:
        if not training.impl.sharded:  # a state_dict round trip replaces the optimizer
            auditor.optimizer = training.optimizer
        audit(f"step {step}", auditor.state_tensors())

    try:
        audit("construction", auditor.state_tensors())
        training.run(
            after_sync=lambda step: audit(f"step {step} gradients", auditor.grad_tensors()),
            after_step=after_step,
        )
    except _Mismatch as mismatch:
        return CheckResult("fail", str(mismatch))
    return CheckResult("pass", f"replicas bitwise identical at all {audits} checkpoints")


class _Mismatch(Exception):
    """Raised the same way on every rank (audits agree), so it ends the loop on all of them."""


def _shard(ctx: RankContext, impl_name: str, b: Behaviour) -> CheckResult:
    training = _Training(ctx, impl_name, b)
    reason = not_claimed(training.wrapped, b)
    if reason:
        return CheckResult("not claimed", reason)
    training.run()
    return check_shard_sizes(training.model, training.optimizer, ctx.world_size)


# --- the shard check -----------------------------------------------------------------------


def check_shard_sizes(
    model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int
) -> CheckResult:
    """Is each rank's optimizer state about 1/N of the unsharded optimizer's? A collective.

    The unsharded size is measured, not assumed: a plain `torch.optim.AdamW` stepped once on
    copies of the parameters that hold state on some rank gives each one's state bytes. Two
    conditions, both sound for any correct whole-parameter partition:

    - the ranks' states add up to at most the unsharded state: no parameter's state is kept on
      two ranks (a ZeRO that does not shard holds N times it);
    - the largest rank holds at most (2 - 1/N) x B, where B = max(total / N, largest single
      state) is a lower bound on any whole-parameter partition. Greedy list scheduling (each
      parameter to the least-loaded rank, in any order: PyTorch's ZeroRedundancyOptimizer)
      never exceeds it (Graham, 1966); LPT (the built-in ZeRO-1) stays within 4/3 of optimal.
    """
    state = local_optimizer_state(optimizer)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    mine = sorted(index[id(p)] for p in state if id(p) in index)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (sum(_state_bytes(s) for s in state.values()), mine))
    held = sorted({i for _, indices in gathered for i in indices})  # state somewhere
    sizes = unsharded_state_bytes([params[i] for i in held])
    total, largest = sum(sizes), max(sizes, default=0)
    bound = max(-(-total // world_size), largest)
    limit = (2 - 1 / world_size) * bound
    locals_ = [g[0] for g in gathered]
    detail = (
        f"state bytes per rank {locals_} vs unsharded {total} "
        f"(1/N bound {bound}, limit {limit:.0f})"
    )
    if sum(locals_) > total:
        return CheckResult("fail", f"state kept on several ranks: {detail}")
    if max(locals_) > limit:
        return CheckResult("fail", f"unbalanced: {detail}")
    return CheckResult("pass", f"max {max(locals_) / bound:.2f} x the 1/N bound: {detail}")


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The state this rank holds: PyTorch's ZeroRedundancyOptimizer keeps its shard's in the
    local optimizer `.optim` (its own `.state` is only filled by `load_state_dict`); the
    built-in ZeRO-1 and most others expose it as `.state`."""
    inner = getattr(optimizer, "optim", None)
    return (inner if isinstance(inner, torch.optim.Optimizer) else optimizer).state


def unsharded_state_bytes(params: list[torch.Tensor]) -> list[int]:
    """State bytes of each parameter under a plain AdamW, the optimizer every cell trains
    with (its state does not depend on the hyper-parameters)."""
    copies = [p.detach().clone().requires_grad_() for p in params]
    for c in copies:
        c.grad = torch.zeros_like(c)
    probe = torch.optim.AdamW(copies)
    probe.step()
    return [_state_bytes(probe.state[c]) for c in copies]


def _state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))


# --- the training loop both checks share ---------------------------------------------------


class _Training:
    """A replica trained under one behaviour, as `equivalence.py` trains it (without the
    reference): the same seeds, batches, optimizer, scheduler and round trip."""

    def __init__(self, ctx: RankContext, impl_name: str, b: Behaviour, *, seed: int = 0) -> None:
        self.ctx = ctx
        self.options = equivalence_options(impl_name, b)
        self.impl = resolve(impl_name)
        self.workload = get_workload(b.workload, seed=seed)
        torch.manual_seed(seed * 1000 + ctx.rank)  # replicas agree only if the wrapper broadcasts
        self.model = self.workload.build().to(ctx.device)
        self.wrapped = self.impl.wrap(
            self.model,
            bucket_size_mb=self.options.bucket_mb,
            find_unused_parameters=self.workload.has_unused_parameters,
        )
        self.optimizer, self.scheduler = self._optimizer()

    def _optimizer(self):
        o = self.options
        groups = self.workload.param_groups(self.model, lr=o.lr, weight_decay=o.weight_decay)
        optimizer = self.impl.make_optimizer(groups, torch.optim.AdamW)
        scheduler = None
        if o.scheduler:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=SCHEDULER_GAMMA)
        return optimizer, scheduler

    def run(
        self,
        after_sync: Callable[[int], object] = lambda step: None,
        after_step: Callable[[int], object] = lambda step: None,
    ) -> None:
        o, ctx, ws = self.options, self.ctx, self.ctx.world_size
        start_batch = getattr(self.wrapped, "on_train_batch_start", None)
        finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        for step in range(1, o.steps + 1):
            if start_batch is not None:
                start_batch()
            self.optimizer.zero_grad(set_to_none=o.set_to_none)
            for micro in range(o.accumulate):
                batch = self.workload.batch((step - 1) * o.accumulate + micro + 1, ws)
                last = micro == o.accumulate - 1
                with nullcontext() if last else self.wrapped.no_sync():
                    shard = batch.shard(ctx.rank, ws).to(ctx.device)
                    (self.workload.loss(self.wrapped, shard) / o.accumulate).backward()
            if finish is not None:
                finish()
            after_sync(step)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            after_step(step)
            if step == o.round_trip_step:
                self._round_trip()

    def _round_trip(self) -> None:
        saved = full_state_dict(self.optimizer, self.ctx)
        sched_saved = self.scheduler.state_dict() if self.scheduler is not None else None
        self.optimizer = self.scheduler = None
        self.optimizer, self.scheduler = self._optimizer()
        self.optimizer.load_state_dict(saved)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sched_saved)
