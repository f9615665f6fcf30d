"""The single-process reference the equivalence check compares every rank with.

`Reference` attaches to the trainer (`training/trainer.py`) as hooks. In each rank it builds a
second model from rank 0's seed with a plain optimizer of the same class, groups and
scheduler, and trains it on the same global batches, in the ranks' shards: for each
micro-batch, shard r's forward and backward give g_r, exactly as rank r computes it; the
reference gradient is their average (in float64). Then, each step:

1. construction: parameters and buffers must equal the reference bitwise (a broadcast copies
   bits). If they do not, that is a finding, and the replica is reset to rank 0's
   initialization so the run goes on and later bugs show;
2. after the synchronization: every gradient against the average, with the tolerance of
   `tolerances.gradient_tolerance` (the all-reduce's rounding in the gradient's own dtype),
   including which gradients are None;
3. after the step: parameters and buffers against the reference stepped by the plain
   optimizer; then the reference is re-anchored to this rank's parameters, so each step is
   judged on its own arithmetic (rounding differences would otherwise compound) and a fault
   shows at the first step it acts in;
4. after a state_dict round trip that failed: the reference restarts from a fresh optimizer
   too, so the checks after it judge what the class does next, not the state it lost.

Buffers a forward updates (a counter, an EMA of a weight) move once per micro-batch on the
replica, so the reference keeps the buffers of shard 0's forward, as broadcast buffers would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from verify.checks import tolerances
from verify.checks.verdict import Finding
from verify.hints import kinds
from verify.replica_audit.fingerprint import fingerprint
from verify.replica_audit.measure import fitted_scale
from verify.training.hooks import Hooks
from verify.training.sharded import assign_full, full_gradients, full_parameters
from verify.training.trainer import SCHEDULER_GAMMA, SGD_MOMENTUM, Trainer
from verify.training.workloads import Batch

PLAYED = "the checkpoint was played as"  # a report's note after the state_dict round trip
NO_BROADCAST = (
    "parameters differ from rank 0's initialization: they were not broadcast from rank 0 (if "
    "the design seeds every rank alike instead, run with --same-init)"
)


@dataclass(frozen=True)
class TensorError:
    """How far one tensor is from the reference: at one check, or the worst over a run.

    `max_rel` is `max_abs` relative to the tensor's scale (max |reference|), not element by
    element: an element whose true value is zero has no meaningful relative error.
    `tolerance` is the one at the element with the worst error/tolerance `ratio`; the tensor
    passes when `ratio <= 1`. Measured for a tensor that failed, for the hint: `scale`, the
    factor c with which it is c x the reference to rounding (`measure.fitted_scale`, else
    None), and `digest`, its bits' fingerprint (equal on two ranks: they hold the same values).
    `missing`: "here" (no gradient where the reference has one), "reference" (the reverse) or
    "shape" (dtype or shape differ), when the comparison could not be numeric.
    """

    kind: str  # "gradients" | "parameters" | "buffers"
    tensor: str
    step: int  # 0: construction
    rank: int
    max_abs: float
    max_rel: float
    tolerance: float
    ratio: float
    detail: str = ""  # why the comparison could not be numeric (a None gradient, a shape)
    scale: float | None = None
    digest: int | None = None
    missing: str = ""

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0

    def describe(self) -> str:
        where = "construction" if self.step == 0 else f"step {self.step}"
        head = f"{where} {self.kind}: {self.tensor} on rank {self.rank}"
        if self.detail:
            return f"{head}: {self.detail}"
        return (
            f"{head}: max |err| {self.max_abs:.3g} ({self.max_rel:.3g} of max |reference|), "
            f"tolerance {self.tolerance:.3g}"
        )


def compare(kind, name, got, ref, tolerance, *, step: int, rank: int, dtype=None) -> TensorError:
    """`got` against `ref`, elementwise within `tolerance` (0: bitwise); NaN never passes.
    `dtype`: the dtype `got` must have when `ref` is kept wider (the exact float64 average)."""
    if got is None or ref is None:
        if got is None and ref is None:
            return TensorError(kind, name, step, rank, 0.0, 0.0, 0.0, 0.0, "None in both")
        detail = (
            "gradient is None, the reference has one"
            if got is None
            else "has a gradient, the reference's is None (unused in one process)"
        )
        missing = "here" if got is None else "reference"
        return TensorError(
            kind, name, step, rank, math.inf, math.inf, 0.0, math.inf, detail, missing=missing
        )
    want = dtype or ref.dtype
    if got.shape != ref.shape or got.dtype != want:
        detail = f"{got.dtype}{tuple(got.shape)} vs reference {want}{tuple(ref.shape)}"
        return TensorError(
            kind, name, step, rank, math.inf, math.inf, 0.0, math.inf, detail, missing="shape"
        )
    if got.numel() == 0:
        return TensorError(kind, name, step, rank, 0.0, 0.0, 0.0, 0.0)
    g, r = got.detach().double().flatten(), ref.detach().double().flatten()
    diff = (g - r).abs().nan_to_num(nan=math.inf)
    tol = torch.as_tensor(tolerance, dtype=torch.float64, device=diff.device)
    tol = tol.flatten() if tol.dim() else tol.expand_as(r)
    ratio = torch.where(diff == 0, 0.0, diff / tol)  # x / 0 = inf: any difference fails
    worst = int(ratio.argmax())
    max_abs = float(diff.max())
    scale = float(r.abs().max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    error = TensorError(
        kind, name, step, rank, max_abs, max_rel, float(tol[worst]), float(ratio[worst])
    )
    if error.passed:
        return error
    digest = hash(tuple(fingerprint(got).tolist()))  # ints hash alike in every process
    return replace(error, scale=fitted_scale(g, r), digest=digest)


class Reference(Hooks):
    """The reference, trained beside the replica (module docstring). `checked` holds every
    comparison in order; `findings` what is not a tensor comparison (construction)."""

    def __init__(self) -> None:
        self.checked: list[TensorError] = []
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.tau: dict[str, float] = {}  # per parameter: largest gradient tolerance so far
        self.updates: dict[str, int] = {}  # per parameter: optimizer steps that updated it

    # --- construction ----------------------------------------------------------------------

    def after_build(self, run: Trainer) -> None:
        spec, ctx = run.spec, run.ctx
        self.rank, self.world = ctx.rank, ctx.world_size
        self.cuda = ctx.device.type == "cuda"
        torch.manual_seed(spec.seed * 1000)  # rank 0's initialization
        self.model = run.workload.build().to(ctx.device)
        self.optimizer, self.scheduler = self._optimizer(run)
        found = self._check_state(run, step=0)
        bad = [e for e in found if not e.passed]
        if bad:
            if any(e.kind == "parameters" for e in bad):
                first = next(e for e in bad if e.kind == "parameters")
                more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
                message = f"{first.describe()}{more}: {NO_BROADCAST}"
                self.findings.append(
                    Finding(
                        "equivalence",
                        "construction",
                        0,
                        message,
                        first.tensor,
                        (self.rank,),
                        kind=kinds.NOT_BROADCAST,
                        numbers={"buffers_only": False},
                    )  # fmt: skip
                )
            with torch.no_grad():  # go on from rank 0's initialization: later bugs still show
                for (_, mine), (_, ref) in zip(_state(run.model), _state(self.model), strict=True):
                    assign_full(mine, ref)

    def _optimizer(self, run: Trainer):
        s = run.spec
        groups = run.workload.param_groups(self.model, lr=s.lr, weight_decay=s.weight_decay)
        if s.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups)
        else:
            optimizer = torch.optim.SGD(groups, momentum=SGD_MOMENTUM)
        scheduler = None
        if s.scheduler:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=SCHEDULER_GAMMA)
        return optimizer, scheduler

    # --- one step --------------------------------------------------------------------------

    def before_step(self, run: Trainer, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=run.spec.set_to_none)
        params = self._trainable()
        self.start = {n: p.grad for n, p in params.items()}  # None, or zeros (set_to_none=False)
        self.shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world)]

    def after_backward(self, run: Trainer, step: int, micro: int, batch: Batch) -> None:
        """Shard by shard, what each rank computed: g_r, accumulated over micro-batches."""
        params = self._trainable()
        before = [b.detach().clone() for _, b in self.model.named_buffers()]
        after_first = before
        for r in range(self.world):
            with torch.no_grad():
                for (_, b), saved in zip(self.model.named_buffers(), before, strict=True):
                    b.copy_(saved)
            for p in params.values():
                p.grad = None
            shard = batch.shard(r, self.world).to(run.ctx.device)
            (run.workload.loss(self.model, shard) / run.spec.accumulate).backward()
            for name, p in params.items():
                if p.grad is None:
                    continue
                acc = self.shards[r]
                acc[name] = p.grad if name not in acc else acc[name].add_(p.grad)
            if r == 0:
                after_first = [b.detach().clone() for _, b in self.model.named_buffers()]
        with torch.no_grad():
            for (_, b), kept in zip(self.model.named_buffers(), after_first, strict=True):
                b.copy_(kept)

    def after_sync(self, run: Trainer, step: int) -> None:
        """Every gradient against the average of the shards' (module docstring, item 2)."""
        found = []
        grads = full_gradients(run.model, run.wrapped)  # a sharded class puts them together
        for name, p in self._trainable().items():
            parts = [acc[name] for acc in self.shards if name in acc]
            if not parts:  # no shard used it: its gradient is what zero_grad left
                p.grad = self.start[name]
                found.append(
                    compare(
                        "gradients", name, grads[name], p.grad, 0.0, step=step, rank=self.rank
                    )  # fmt: skip
                )
                continue
            # Shards that did not use it contribute zeros (they count in the average).
            total = torch.stack([g.double() for g in parts]).sum(0)
            mean = total / self.world
            abs_mean = torch.stack([g.double().abs() for g in parts]).sum(0) / self.world
            tol = tolerances.gradient_tolerance(p.dtype, self.world, abs_mean, mean, cuda=self.cuda)
            self.tau[name] = max(self.tau.get(name, 0.0), float(tol.max()))
            p.grad = mean.to(p.dtype)
            found.append(
                compare(
                    "gradients",
                    name,
                    grads[name],
                    mean,
                    tol,
                    step=step,
                    rank=self.rank,
                    dtype=p.dtype,
                )  # fmt: skip
            )
        self.checked.extend(found)
        # The lr each parameter's step uses, before the scheduler moves it.
        self.groups = {id(p): dict(g) for g in self.optimizer.param_groups for p in g["params"]}
        self.stepped = {n for n, p in self._trainable().items() if p.grad is not None}
        for name in self.stepped:
            self.updates[name] = self.updates.get(name, 0) + 1

    def after_step(self, run: Trainer, step: int) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self._check_state(run, step)
        with torch.no_grad():  # re-anchor: the next step starts from this rank's state
            params = full_parameters(run.model, run.wrapped)  # a sharded class's put together
            mine_full = [*params.items(), *run.model.named_buffers()]
            for (_, mine), (_, ref) in zip(mine_full, _state(self.model), strict=True):
                ref.copy_(mine)

    def after_load(self, run: Trainer, step: int, error: Exception | None) -> None:
        if error is None:
            kind, why = run.round_trip.kind, run.round_trip.note
            self.notes.append(f"{PLAYED} {kind}" + (f": {why}" if why else ""))
            return
        message = (
            f"step {step} state_dict round trip: {error} (training went on from a fresh optimizer)"
        )
        self.findings.append(
            Finding("equivalence", "checkpoint", step, message, ranks=(self.rank,),
                    kind=kinds.ROUND_TRIP_RAISED, numbers={"exception": type(error).__name__})
        )  # fmt: skip
        sched = self.scheduler.state_dict() if self.scheduler is not None else None
        self.optimizer, self.scheduler = self._optimizer(run)  # both sides restart
        if sched is not None:
            self.scheduler.load_state_dict(sched)

    # --- comparisons -----------------------------------------------------------------------

    def _check_state(self, run: Trainer, step: int) -> list[TensorError]:
        """Parameters and buffers; at construction bitwise."""
        found = []
        ref_params = dict(self.model.named_parameters())
        for name, param in full_parameters(run.model, run.wrapped).items():
            ref = ref_params[name]
            tol = 0.0 if step == 0 else self._param_tol(run, name, ref)
            found.append(compare("parameters", name, param, ref, tol, step=step, rank=self.rank))
        ref_buffers = dict(self.model.named_buffers())
        for name, buf in run.model.named_buffers():
            ref = ref_buffers[name]
            tol = 0.0 if step == 0 else tolerances.buffer_tolerance(ref)
            found.append(compare("buffers", name, buf, ref, tol, step=step, rank=self.rank))
        self.checked.extend(found)
        return found

    def _param_tol(self, run: Trainer, name: str, ref: torch.Tensor) -> torch.Tensor:
        return tolerances.parameter_tolerance(
            ref,
            self.optimizer.state.get(ref, {}),
            self.groups.get(id(ref), {"lr": 0.0}),
            optimizer=run.spec.optimizer,
            tau=self.tau.get(name, 0.0),
            stepped=name in self.stepped,
            updates=self.updates.get(name, 0),
            momentum=SGD_MOMENTUM,
        )

    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]
