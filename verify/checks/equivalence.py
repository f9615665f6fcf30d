"""The equivalence check: does data-parallel training compute what one process computes?

Every rank builds two models: its replica, seeded differently on each rank and wrapped by the
implementation (so it only starts right if the wrapper broadcasts from rank 0), and a
*reference* built from rank 0's seed, trained in the same process by a plain optimizer on the
whole global batch. Per-example routing travels in the batch (see `workloads.py`), so the
reference computes exactly what the ranks compute together, up to rounding. Then, each step:

1. construction (step 0): parameters and buffers must equal the reference *bitwise*, since a
   broadcast copies bits;
2. `zero_grad(set_to_none=...)`, forward and backward of every micro-batch (all but the last
   under `no_sync()` when accumulating), `finish_gradient_synchronization()` if the wrapper
   has it: every rank's gradients against the reference's on the global batch, including
   which gradients are None (a parameter unused on every rank has none in one process too);
3. `optimizer.step()`, and the LR scheduler: parameters and buffers against the reference
   stepped by the unsharded optimizer class;
4. the reference is re-anchored: its parameters and buffers are set to this rank's. Rounding
   differences would otherwise compound through the loss landscape (AdamW turns a gradient
   that is zero up to rounding into a full `lr`-sized step of random sign; the next step's
   gradients then differ by curvature x lr, far above rounding). Anchored, every step is
   judged on that step's own arithmetic, with tolerances that can be derived, and a fault
   still shows at the first step it acts in;
5. midway (sharded optimizers especially): the optimizer's full `state_dict()` is saved, a
   fresh optimizer and scheduler are built and loaded from it, and training continues.

Tolerances (why each is what it is) are in the section "Tolerances" below. Errors are
reported per tensor (worst over steps and ranks) and the first divergence names the step, the
tensor and whether gradients or parameters went wrong first.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from impls.registry import DEFAULT_BUCKET_MB, resolve
from verify.launching import RankContext, launch
from verify.training.workloads import get_workload

OPTIMIZERS = ("adamw", "sgd")
SGD_MOMENTUM = 0.9
SCHEDULER_GAMMA = 0.5  # StepLR(step_size=1): the learning rate halves after every step
PHASES = ("gradients", "parameters", "buffers")  # order of the checks within a step


@dataclass(frozen=True, kw_only=True)
class EquivalenceOptions:
    """What to run; validated on construction so bad input fails before any rank starts.

    Beyond ConsistencyOptions' fields:
        optimizer: "adamw" (decoupled weight decay) or "sgd" (momentum 0.9), built over the
            workload's two parameter groups (the second at half the learning rate).
        weight_decay: of the first (decayed) group.
        accumulate: micro-batches per step; all but the last run under `no_sync()`.
        set_to_none: passed to `zero_grad()`; False keeps zeroed gradient tensors.
        scheduler: step a StepLR (halving the learning rate) after every optimizer step.
        round_trip: after step `steps // 2`, save the optimizer's full state dict, build a
            fresh optimizer and scheduler, load it and continue (needs steps >= 2).
    """

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
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    accumulate: int = 1
    set_to_none: bool = True
    scheduler: bool = True
    round_trip: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket size must be > 0 MB, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 micro-batch, got {self.accumulate}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        if self.backend == "nccl" and torch.cuda.device_count() < self.world_size:
            raise ValueError(
                f"backend nccl needs one GPU per rank: world size {self.world_size}, "
                f"{torch.cuda.device_count()} GPU(s) visible"
            )
        resolve(self.impl)  # raises ImplError (a ValueError) naming the problem
        get_workload(self.workload)

    @property
    def round_trip_step(self) -> int | None:
        """The step after which the optimizer state is saved and reloaded, if any."""
        return self.steps // 2 if self.round_trip and self.steps >= 2 else None


@dataclass(frozen=True)
class TensorError:
    """How far one tensor is from the reference: at one check, or the worst over a run.

    `max_rel` is `max_abs` relative to the tensor's scale (max |reference|), not element by
    element: an element whose true value is zero has no meaningful relative error.
    `tolerance` is the one at the element with the worst error/tolerance `ratio`; the tensor
    passes when `ratio <= 1`.
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


@dataclass(frozen=True)
class EquivalenceReport:
    """One cell's answer, as `run_equivalence_on_rank` returns it (the same on every rank).

    `rows` holds the worst error of every tensor over all steps and ranks, in check order;
    `first_divergence` the first tensor over tolerance at the earliest failing check (step,
    then gradients before parameters), and `also_diverged` how many other tensors failed at
    that same check. `unsupported` says why the cell could not run (e.g. `accumulate > 1` for
    a wrapper without `no_sync()`): neither a pass nor a fault.
    """

    rows: tuple[TensorError, ...] = ()
    first_divergence: TensorError | None = None
    also_diverged: int = 0
    checks: int = 0
    notes: tuple[str, ...] = ()
    unsupported: str | None = None

    @property
    def passed(self) -> bool:
        return self.unsupported is None and self.first_divergence is None

    def describe(self) -> str:
        if self.unsupported:
            return f"NOT CLAIMED: {self.unsupported}"
        if self.first_divergence is None:
            return f"PASS: all {self.checks} tensor checks within tolerance"
        more = f" (and {self.also_diverged} more tensors there)" if self.also_diverged else ""
        return f"FAULT: first divergence at {self.first_divergence.describe()}{more}"


@dataclass(frozen=True)
class EquivalenceResult:
    """The verdict of `check_equivalence`: a report, or the launcher's failure summary."""

    options: EquivalenceOptions
    passed: bool
    report: EquivalenceReport | None = None
    failure: str | None = None  # a rank raised, crashed or timed out: the launcher's summary
    elapsed_s: float = 0.0

    @property
    def verdict(self) -> str:
        if self.failure:
            return f"FAULT: {self.failure.splitlines()[0]}"
        assert self.report is not None
        if self.passed:
            o = self.options
            return (
                f"PASS: gradients and parameters match one process on all {o.world_size} "
                f"ranks for {o.steps} steps ({self.report.checks} tensor checks)"
            )
        return self.report.describe()

    def to_dict(self) -> dict:
        return _finite({"check": "equivalence", "verdict": self.verdict, **asdict(self)})


def check_equivalence(options: EquivalenceOptions) -> EquivalenceResult:
    """Run the equivalence check; a failing rank or a hang comes back as a failed result."""
    start = time.perf_counter()
    run = launch(
        run_equivalence_on_rank,
        world_size=options.world_size,
        args=(options,),
        timeout_s=options.timeout_s,
        backend=options.backend,
    )
    elapsed = time.perf_counter() - start
    if not run.ok:
        return EquivalenceResult(options, False, failure=run.summary(), elapsed_s=elapsed)
    report: EquivalenceReport = run.values[0]
    return EquivalenceResult(options, report.passed, report, None, elapsed)


def run_equivalence_on_rank(ctx: RankContext, options: EquivalenceOptions) -> EquivalenceReport:
    """The check as one rank runs it, inside an already launched job (the certification
    matrix runs many of these in one launch). A collective: call it on every rank with the
    same options. Every rank returns the same report.

    It builds everything it uses, seeds explicitly, and restores torch's random state on
    return, so cells can follow each other in one process in any order.
    """
    devices = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        local = _Cell(ctx, options).run()
    if ctx.world_size == 1:
        return _merge([local])
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, local)
    return _merge(gathered)


# --- Tolerances ----------------------------------------------------------------------------
#
# Gradients. The reference computes the mean loss over the global batch in one backward; the
# ranks compute means over their shards, the all-reduce adds the ranks' values (in an order
# that, for gloo's ring on 3+ ranks, depends on the element's offset) and divides by the world
# size before or after. Same mathematical value, different rounding: matmuls of a different
# height may take different kernels (another blocking of the sum over examples), the mean's
# 1/N is applied in pieces, and for 3+ ranks the ranks' order differs. Each rounding is
# relative to the size of the *summands*, which can exceed the result (cancellation), so the
# error is measured in ulps of the tensor's scale, max |reference gradient|, not element by
# element:
#
# - float32/float64 models: the sums over examples run in the working precision, so the
#   error grows with their length and the depth (random-walk rounding, ~sqrt(n) ulps).
#   Measured over every hard-case workload at 2-4 ranks and a 5M-parameter GPT (8 layers,
#   1024 rows a sum): at most 12 ulps. GRAD_ULPS 64 (7.6e-6 of the scale) leaves 5x
#   headroom and is still ~1e4 times below what a wrong average does (world size forgotten
#   or hard-coded: an error of 50-200% of the scale; a rank's gradient dropped: its 1/N share).
# - bf16/fp16 models: matmuls accumulate in float32 and round once to 16 bits, so the error
#   is a few roundings of the output (measured: at most 2 ulps). LOW_PRECISION_GRAD_ULPS 16
#   leaves 8x headroom; 16 bf16 ulps is 12.5% of the scale, still 4x below a halved average.
#
# A tensor whose gradient is zero in exact arithmetic has a scale made of rounding noise, so
# its own scale gives it no room. Its noise comes from summands the size of the model's other
# gradients: the key third of an attention bias (softmax ignores a shift shared by all keys)
# measured at most 0.03 eps x (the model's largest gradient scale). Every tensor's scale is
# therefore floored at GRAD_FLOOR (1%) of the model's largest gradient scale: 20x headroom.
#
# eps is that of the least precise floating dtype in the model, for every tensor: one bf16
# layer rounds its activations to 8 bits, and every gradient upstream or downstream of it is
# computed from them, whatever its own dtype.
GRAD_ULPS = 64.0
LOW_PRECISION_GRAD_ULPS = 16.0
GRAD_FLOOR = 1e-2
#
# Parameters. With the reference re-anchored, both sides step from the same parameters with
# gradients that differ by at most the gradient tolerance tau (else the gradient check has
# already failed). For AdamW, the update is lr * u, u = m_hat / (sqrt(v_hat) + eps_adam), with
# m_hat and v_hat weighted averages of the gradients so far (weights summing to 1). Then
# |d m_hat| <= tau, |d sqrt(v_hat)| <= tau (Minkowski), |u| <= U_k (Cauchy-Schwarz over the
# weights, 1 at the first step, 1.001 at the second), and
#     |d u| <= min(2 U_k, (1 + U_k) tau / (sqrt(v_hat) - tau + eps_adam)).
# Where the gradient is far above its noise, that is ~tau/|g|: tiny. Where it is below it
# (|g| <~ tau, the key bias again), the sign of the update is decided by rounding and the
# bound is the honest 2 U_k: up to two full lr-sized steps apart, for those elements only. A
# correct optimizer on a wrong gradient, or a wrong optimizer (a group's lr lost, parameters
# never synchronized, state lost in a checkpoint) moves elements with real gradients by ~lr,
# hundreds of times their tolerance. For SGD with momentum mu, |d buffer| <= tau sum mu^j.
# On top, PARAM_EPS ulps of the parameter's own dtype: each side rounds the updated parameter
# once (half an ulp each), and bf16 AdamW also rounds u.
PARAM_EPS = 2.0
# Buffers: computed from parameters and data by the same ops on both sides (an EMA of a
# weight, a counter); float buffers get the gradient tolerance, integer buffers none.


def model_precision(module: nn.Module) -> tuple[float, float]:
    """(eps, ulps): eps of the least precise floating dtype among the module's parameters and
    buffers, and how many of them a gradient may be off (see "Tolerances")."""
    dtypes = {t.dtype for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()}
    eps = max((torch.finfo(d).eps for d in dtypes), default=torch.finfo(torch.float32).eps)
    low = eps >= torch.finfo(torch.float16).eps
    return eps, LOW_PRECISION_GRAD_ULPS if low else GRAD_ULPS


def gradient_tolerance(scale: float, model_scale: float, precision: tuple[float, float]) -> float:
    """Absolute tolerance of a gradient tensor whose max |reference| is `scale`, in a model
    whose largest gradient scale is `model_scale` (see "Tolerances")."""
    eps, ulps = precision
    return ulps * eps * max(scale, GRAD_FLOOR * model_scale)


def adam_update_bound(beta1: float, beta2: float, k: int) -> float:
    """U_k: the largest |m_hat / sqrt(v_hat)| any gradient history of k steps can give."""
    w1 = [(1 - beta1) * beta1 ** (k - s) / (1 - beta1**k) for s in range(1, k + 1)]
    w2 = [(1 - beta2) * beta2 ** (k - s) / (1 - beta2**k) for s in range(1, k + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(w1, w2)))


def parameter_tolerance(
    ref_param: torch.Tensor,
    state: dict,
    group: dict,
    *,
    optimizer: str,
    tau: float,
    stepped: bool,
    updates: int,
) -> torch.Tensor:
    """Per-element tolerance of a parameter after one step (see "Tolerances").

    Args:
        ref_param: the reference parameter after the step.
        state: the reference optimizer's state for it (after the step).
        group: its parameter group; `lr` must be the one the step used.
        tau: the largest gradient tolerance this parameter had in any step so far.
        stepped: whether the optimizer updated it in this step (it had a gradient).
        updates: how many steps have updated it so far, this one included.
    """
    p = ref_param.detach().double().abs()
    eps_p = torch.finfo(ref_param.dtype).eps if ref_param.is_floating_point() else 0.0
    lr = float(group["lr"])
    if not stepped:
        return PARAM_EPS * eps_p * p  # untouched on both sides: only a copy's rounding
    if optimizer == "adamw":
        beta1, beta2 = group["betas"]
        k = int(state["step"])
        u_max = adam_update_bound(beta1, beta2, k)
        sqrt_v = (state["exp_avg_sq"].detach().double() / (1 - beta2**k)).sqrt()
        room = (sqrt_v - tau + group["eps"]).clamp_min(1e-300)
        du = ((1 + u_max) * tau / room).clamp_max(2 * u_max)
    else:  # sgd: the momentum buffer sums k gradients with weights mu^j
        du = torch.full_like(p, tau * sum(SGD_MOMENTUM**j for j in range(updates)))
        u_max = state["momentum_buffer"].detach().double().abs()
    return lr * du + PARAM_EPS * eps_p * (p + lr * u_max)


def compare(
    kind: str,
    name: str,
    got: torch.Tensor | None,
    ref: torch.Tensor | None,
    tolerance: float | torch.Tensor,
    *,
    step: int,
    rank: int,
) -> TensorError:
    """`got` against `ref`, elementwise within `tolerance` (0: bitwise); NaN never passes."""
    if got is None or ref is None:
        if got is None and ref is None:
            return TensorError(kind, name, step, rank, 0.0, 0.0, 0.0, 0.0, "None in both")
        detail = (
            "gradient is None, the reference has one"
            if got is None
            else "has a gradient, the reference's is None (unused in one process)"
        )
        return TensorError(kind, name, step, rank, math.inf, math.inf, 0.0, math.inf, detail)
    if got.shape != ref.shape or got.dtype != ref.dtype:
        detail = f"{got.dtype}{tuple(got.shape)} vs reference {ref.dtype}{tuple(ref.shape)}"
        return TensorError(kind, name, step, rank, math.inf, math.inf, 0.0, math.inf, detail)
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
    return TensorError(
        kind, name, step, rank, max_abs, max_rel, float(tol[worst]), float(ratio[worst])
    )


# --- one cell, as one rank runs it ---------------------------------------------------------


class _Cell:
    """A replica and its single-process reference, trained side by side (module docstring)."""

    def __init__(self, ctx: RankContext, options: EquivalenceOptions) -> None:
        self.ctx, self.o = ctx, options
        self.impl = resolve(options.impl)
        self.workload = get_workload(
            options.workload, seed=options.seed, size_m=options.model_size_m
        )
        # Different on purpose: the replicas start equal to the reference (rank 0's seed) only
        # if the wrapper broadcasts from rank 0 at construction.
        torch.manual_seed(options.seed * 1000 + ctx.rank)
        self.model = self.workload.build().to(ctx.device)
        torch.manual_seed(options.seed * 1000)
        self.reference = self.workload.build().to(ctx.device)
        self.wrapped = self.impl.wrap(
            self.model,
            bucket_size_mb=options.bucket_mb,
            find_unused_parameters=self.workload.has_unused_parameters,
        )
        self.optimizer, self.scheduler = self._optimizer(self.model, self.impl.make_optimizer)
        self.ref_optimizer, self.ref_scheduler = self._optimizer(self.reference, _plain)
        self.precision = model_precision(self.model)
        self.tau: dict[str, float] = {}  # per parameter: largest gradient tolerance so far
        self.updates: dict[str, int] = {}  # per parameter: optimizer steps that updated it
        self.checked: list[TensorError] = []  # every check, in order

    def _optimizer(self, module: nn.Module, make) -> tuple:
        o = self.o
        groups = self.workload.param_groups(module, lr=o.lr, weight_decay=o.weight_decay)
        if o.optimizer == "adamw":
            optimizer = make(groups, torch.optim.AdamW)
        else:
            optimizer = make(groups, torch.optim.SGD, momentum=SGD_MOMENTUM)
        scheduler = None
        if o.scheduler:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=SCHEDULER_GAMMA)
        return optimizer, scheduler

    def run(self) -> EquivalenceReport:
        o = self.o
        if o.accumulate > 1 and not hasattr(self.wrapped, "no_sync"):
            return EquivalenceReport(
                unsupported="gradient accumulation: the wrapper has no no_sync()"
            )
        self._check_state(step=0)
        for step in range(1, o.steps + 1):
            self._step(step)
            if step == o.round_trip_step:
                self._round_trip()
        # Every check, not only the worst: merging the ranks' reports needs them in order.
        return EquivalenceReport(rows=tuple(self.checked), notes=self._notes())

    def _step(self, step: int) -> None:
        o, ctx, ws = self.o, self.ctx, self.ctx.world_size
        start_batch = getattr(self.wrapped, "on_train_batch_start", None)
        finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        if start_batch is not None:
            start_batch()
        self.optimizer.zero_grad(set_to_none=o.set_to_none)
        self.ref_optimizer.zero_grad(set_to_none=o.set_to_none)
        for micro in range(o.accumulate):
            batch = self.workload.batch((step - 1) * o.accumulate + micro + 1, ws).to(ctx.device)
            last = micro == o.accumulate - 1
            with nullcontext() if last else self.wrapped.no_sync():
                (
                    self.workload.loss(self.wrapped, batch.shard(ctx.rank, ws)) / o.accumulate
                ).backward()
            (self.workload.loss(self.reference, batch) / o.accumulate).backward()
        if finish is not None:
            finish()
        self._check_gradients(step)
        # The lr each parameter's step uses, before the scheduler moves it.
        groups = {id(p): dict(g) for g in self.ref_optimizer.param_groups for p in g["params"]}
        stepped = {n for n, p in self.reference.named_parameters() if p.grad is not None}
        for name in stepped:
            self.updates[name] = self.updates.get(name, 0) + 1
        self.optimizer.step()
        self.ref_optimizer.step()
        for scheduler in (self.scheduler, self.ref_scheduler):
            if scheduler is not None:
                scheduler.step()
        self._check_state(step, groups, stepped)
        with torch.no_grad():  # re-anchor: the next step starts from this rank's state
            for (_, mine), (_, ref) in zip(self._state(self.model), self._state(self.reference)):
                ref.copy_(mine)

    def _check_gradients(self, step: int) -> None:
        ref = {n: p.grad for n, p in self.reference.named_parameters() if p.requires_grad}
        scales = {n: float(g.detach().abs().max()) for n, g in ref.items() if g is not None}
        model_scale = max(scales.values(), default=0.0)
        found = []
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            tau = gradient_tolerance(scales.get(name, 0.0), model_scale, self.precision)
            if ref[name] is not None:
                self.tau[name] = max(self.tau.get(name, 0.0), tau)
            found.append(
                compare(
                    "gradients", name, param.grad, ref[name], tau, step=step, rank=self.ctx.rank
                )
            )
        self._record(found)

    def _check_state(self, step: int, groups: dict | None = None, stepped=frozenset()) -> None:
        """Parameters and buffers; at step 0 (construction) bitwise."""
        found = []
        ref_params = dict(self.reference.named_parameters())
        for name, param in self.model.named_parameters():
            ref = ref_params[name]
            tol = 0.0 if step == 0 else self._param_tol(name, ref, groups, stepped)
            found.append(
                compare("parameters", name, param, ref, tol, step=step, rank=self.ctx.rank)
            )
        ref_buffers = dict(self.reference.named_buffers())
        for name, buf in self.model.named_buffers():
            ref = ref_buffers[name]
            tol = 0.0
            if step > 0 and ref.is_floating_point() and ref.numel():
                tol = gradient_tolerance(float(ref.abs().max()), 0.0, self.precision)
            found.append(compare("buffers", name, buf, ref, tol, step=step, rank=self.ctx.rank))
        self._record(found)

    def _param_tol(self, name, ref, groups, stepped) -> torch.Tensor:
        return parameter_tolerance(
            ref,
            self.ref_optimizer.state.get(ref, {}),
            groups.get(id(ref), {"lr": 0.0}),
            optimizer=self.o.optimizer,
            tau=self.tau.get(name, 0.0),
            stepped=name in stepped,
            updates=self.updates.get(name, 0),
        )

    def _record(self, found: list[TensorError]) -> None:
        self.checked.extend(found)

    def _round_trip(self) -> None:
        """Save the full optimizer and scheduler state, rebuild both, load, continue."""
        saved = full_state_dict(self.optimizer, self.ctx)
        sched_saved = self.scheduler.state_dict() if self.scheduler is not None else None
        self.optimizer = self.scheduler = None  # drop the old ones before building new ones
        self.optimizer, self.scheduler = self._optimizer(self.model, self.impl.make_optimizer)
        # Optimizer first: it restores each group's lr (and initial_lr), which a new
        # scheduler's first step would otherwise have reset.
        self.optimizer.load_state_dict(saved)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sched_saved)

    @staticmethod
    def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [*module.named_parameters(), *module.named_buffers()]

    def _notes(self) -> tuple[str, ...]:
        o = self.o
        lrs = ", ".join(f"{g['lr']:g}" for g in self.workload.param_groups(self.reference, lr=o.lr))
        notes = [
            f"reference: one process on the global batch, {o.optimizer} over "
            f"{len(self.ref_optimizer.param_groups)} parameter groups (lr {lrs})"
            + (f", StepLR gamma {SCHEDULER_GAMMA}" if o.scheduler else "")
        ]
        if o.round_trip_step is not None:
            notes.append(
                f"optimizer state_dict round trip after step {o.round_trip_step}: a fresh "
                "optimizer loaded from rank 0's full state"
            )
        if o.accumulate > 1:
            notes.append(f"{o.accumulate} micro-batches per step, all but the last in no_sync()")
        if not o.set_to_none:
            notes.append("zero_grad(set_to_none=False)")
        return tuple(notes)


def _plain(params, optimizer_cls, **defaults) -> torch.optim.Optimizer:
    return optimizer_cls(params, **defaults)


def full_state_dict(optimizer: torch.optim.Optimizer, ctx: RankContext) -> dict:
    """The optimizer's full (unsharded) state dict, rank 0's copy on every rank.

    ZeroRedundancyOptimizer-style optimizers gather it with `consolidate_state_dict(to=0)`
    and only rank 0 can return it; others (ShardedOptimizer: a collective that returns it
    everywhere; plain optimizers) are asked on every rank. Rank 0's answer is then broadcast,
    so a `state_dict()` that returns only the local shard loses state, visibly.
    """
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
        state = optimizer.state_dict() if ctx.rank == 0 else None
    else:
        state = optimizer.state_dict()
    if ctx.world_size == 1:
        return state
    box = [_to_cpu(state) if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, device=ctx.device if ctx.device.type == "cuda" else None)
    return box[0]


_full_state_dict = full_state_dict  # the name the certification matrix (cells.py) imports


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


# --- merging the ranks' answers ------------------------------------------------------------


def _merge(reports: list[EquivalenceReport]) -> EquivalenceReport:
    """One report from every rank's list of checks: the worst error of each tensor, and the
    first tensor over tolerance at the earliest failing check (lowest rank, model order)."""
    if any(r.unsupported for r in reports):
        return next(r for r in reports if r.unsupported)
    worst: dict[tuple[str, str], TensorError] = {}
    for report in reports:
        for e in report.rows:
            key = (e.kind, e.tensor)
            if key not in worst or e.ratio > worst[key].ratio:
                worst[key] = e
    rows = sorted(worst.values(), key=lambda e: PHASES.index(e.kind))  # stable: model order
    failed = [e for report in reports for e in report.rows if not e.passed]  # rank order
    first, also = None, 0
    if failed:
        when = min(_when(e) for e in failed)
        there = [e for e in failed if _when(e) == when]
        first = there[0]
        also = len({(e.kind, e.tensor) for e in there}) - 1
    return EquivalenceReport(
        rows=tuple(rows),
        first_divergence=first,
        also_diverged=also,
        checks=sum(len(r.rows) for r in reports),
        notes=reports[0].notes,
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
