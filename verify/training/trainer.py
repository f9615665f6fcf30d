"""The one training loop: every check and every measurement trains through `Trainer`.

One step, as a user's training script takes it with a data-parallel wrapper::

    on_train_batch_start()                    # if the wrapper has it
    optimizer.zero_grad(set_to_none=...)
    for each micro-batch:                     # all but the last under wrapper.no_sync()
        loss(wrapper, this rank's shard) / accumulate .backward()
    finish_gradient_synchronization()         # if the wrapper has it
    optimizer.step(); scheduler.step()
    [state_dict round trip]                   # at `round_trip_step` (checkpoint.py), the
                                              # model's too with `round_trip_model` (model_state.py)

Checks attach through `Hooks` (after construction, after each backward with the global batch,
after the synchronization, after the step, after a reload), never by copying the loop.

How replicas are built: the model is seeded differently on every rank (`seed * 1000 + rank`),
so replicas agree only if the wrapper broadcasts from rank 0 at construction; `same_init`
seeds every rank alike, for designs that rely on identical seeding instead (picotron).

Every call into the code under test is made inside `self.calling(what)`, which says, when it
raises, what the tool was doing: "optimizer.step() at step 2, the first step after the
optimizer state_dict round trip". A class the tool cannot construct or call as the contract
says raises `InterfaceError` (`interface.py`): a usage error rather than a fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
from torch import nn
from torch.profiler import record_function

from impls.registry import DEFAULT_BUCKET_MB, Implementation, resolve
from verify.launching.outcome import RankContext
from verify.training import checkpoint, model_state
from verify.training.hooks import Hooks
from verify.training.interface import (
    InterfaceError,
    call_message,
    call_mismatch,
    constructor_message,
    distributed,
)
from verify.training.workloads import Workload, get_workload
from verify.watching import tracer

OPTIMIZERS = ("adamw", "sgd")
SGD_MOMENTUM = 0.9
SCHEDULER_GAMMA = 0.5  # StepLR(step_size=1): the learning rate halves after every step


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """What one run trains. Every knob has one default, here.

    Attributes:
        impl: a registered name or a class spec; None trains the plain model (no wrapper, no
            communication: the compute-only reference of the benchmarks).
        workload, model_size_m, local_batch: see `workloads.py` (None: the workload's own).
        bucket_mb: passed as the wrapper's bucket size (MB).
        steps: optimizer steps.
        accumulate: micro-batches per step; all but the last under `no_sync()`.
        set_to_none: passed to `zero_grad()`.
        optimizer: "adamw" (decoupled weight decay) or "sgd" (momentum 0.9), over the
            workload's two parameter groups (the second at half the learning rate).
        lr, weight_decay: of the first group.
        scheduler: step a StepLR (halving the learning rate) after every optimizer step.
        round_trip_step: after this step, save the optimizer's state, build a fresh one, load.
        round_trip_model: at `round_trip_step`, the model's state_dict too: a fresh model and
            wrapper are built and loaded first, then the optimizer over them.
        add_param_group: build the optimizer over the first group, add the others after.
        same_init: seed every rank alike (no broadcast needed for replicas to agree).
        seed: data and initialization seed.
    """

    impl: str | None
    workload: str = "mlp"
    model_size_m: float | None = None
    local_batch: int | None = None
    bucket_mb: float = DEFAULT_BUCKET_MB
    steps: int = 3
    accumulate: int = 1
    set_to_none: bool = True
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    scheduler: bool = False
    round_trip_step: int | None = None
    round_trip_model: bool = False
    add_param_group: bool = False
    same_init: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.round_trip_step is not None and not 1 <= self.round_trip_step <= self.steps:
            raise ValueError(f"round_trip_step must be in 1..{self.steps}")

    def build_workload(self) -> Workload:
        options = {"seed": self.seed, "size_m": self.model_size_m}
        if self.local_batch is not None:
            options["local_batch"] = self.local_batch
        return get_workload(self.workload, **options)


#: TrainSpec's own defaults: where a command's knob means the same, its default comes from here
TRAIN_DEFAULTS = TrainSpec(impl=None)


def spec_from(options, **overrides) -> TrainSpec:
    """What the ranks train for a command: every field of `options` that `TrainSpec` has too,
    by name (a property counts), then `overrides`. The one place a command's knobs become a
    `TrainSpec`, so no command copies them field by field."""
    names = [f.name for f in fields(TrainSpec)]
    values = {n: getattr(options, n) for n in names if hasattr(options, n)}
    return TrainSpec(**{**values, **overrides})


class Trainer:
    """A replica of `spec` on this rank, trained step by step (module docstring).

    Attributes: `model` (the unwrapped module; names come from it), `wrapped`, `optimizer`,
    `scheduler`, `workload`, `impl`, `round_trip` (the last `checkpoint.RoundTrip`),
    `param_numels` (the sizes of the parameters the optimizer was given, in order).
    """

    def __init__(
        self, ctx: RankContext, spec: TrainSpec, hooks: tuple[Hooks, ...] = (), *, quiet=None
    ) -> None:
        """`quiet()`, when given, is a context manager the hooks run inside: what the tool
        itself reads and writes (audits, the reference) is not the code under test's (the
        race sanitizer's `Sanitizer.quiet`)."""
        self.ctx, self.spec, self.hooks = ctx, spec, tuple(hooks)
        self._quiet = quiet or contextlib.nullcontext
        self.impl: Implementation | None = resolve(spec.impl) if spec.impl else None
        self.workload = spec.build_workload()
        self.step_no = 0
        self.loaded_after: int | None = None  # the step after which state was reloaded
        self.round_trip: checkpoint.RoundTrip | None = None
        self._doing = "construction"
        torch.manual_seed(spec.seed * 1000 + (0 if spec.same_init else ctx.rank))
        self.model, self.wrapped = self._build()
        self.optimizer, self.scheduler = self._make_optimizer()
        self._call("after_build")

    # --- construction ---------------------------------------------------------------------

    def _build(self) -> tuple[nn.Module, nn.Module]:
        """The model from torch's current seed, on this rank's device, and its wrapper."""
        model = self.workload.build().to(self.ctx.device)
        tracer.name_shapes(model.named_parameters())  # the diagnosis names collectives
        if self.impl is None:
            return model, model
        with self._constructing("the wrapper"):
            hints = {"find_unused_parameters": self.workload.has_unused_parameters}
            if self.workload.compute_dtype is not None:  # only where a workload asks for it
                hints["compute_dtype"] = self.workload.compute_dtype
            return model, self.impl.wrap(model, bucket_size_mb=self.spec.bucket_mb, **hints)

    def _rebuild(self) -> tuple[nn.Module, nn.Module]:
        """A fresh model and wrapper for the model's round trip, from another seed than the
        first (a lost load shows), torch's random state left as it was."""
        devices = [self.ctx.device.index or 0] if self.ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            s, rank = self.spec, self.ctx.rank
            torch.manual_seed(s.seed * 1000 + 500 + (0 if s.same_init else rank))
            return self._build()

    def _make_optimizer(self):
        s = self.spec
        groups = self.workload.param_groups(self.model, lr=s.lr, weight_decay=s.weight_decay)
        # What the optimizer was given, by the tool: a per-rank design may trim its own
        # param_groups to its shard, so the checkpoint kind is measured against this.
        self.param_numels = [p.numel() for g in groups for p in g["params"]]
        cls, extra = torch.optim.AdamW, {}
        if s.optimizer == "sgd":
            cls, extra = torch.optim.SGD, {"momentum": SGD_MOMENTUM}
        make = _plain
        if self.impl is not None:  # ZeRO-2's optimizer steps what its wrapper assigned
            make = functools.partial(self.impl.make_optimizer, wrapped=self.wrapped)
        with self._constructing("the optimizer"):
            if s.add_param_group:
                optimizer = make(groups[:1], cls, **extra)
                for group in groups[1:]:
                    optimizer.add_param_group(group)
            else:
                optimizer = make(groups, cls, **extra)
        scheduler = None
        if s.scheduler:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=SCHEDULER_GAMMA)
        return optimizer, scheduler

    @contextlib.contextmanager
    def _constructing(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            if distributed(exc):
                exc.add_note(f"while ddp-verify constructed {what}")
                raise
            message, reason = constructor_message(self.spec.impl, what, exc)
            raise InterfaceError(message, reason, exception=type(exc).__name__, call=what) from exc

    # --- one step -------------------------------------------------------------------------

    def run(self) -> None:
        for step in range(1, self.spec.steps + 1):
            self.step(step)

    def step(self, step: int) -> torch.Tensor:
        """One training step (module docstring), with the hooks called in between. Returns
        this rank's loss of the step (detached: the sum of its micro-batches' scaled losses)."""
        s, ctx, ws = self.spec, self.ctx, self.ctx.world_size
        step_loss = torch.zeros((), device=ctx.device)
        self.step_no = step
        self._call("before_step", step)
        start_batch = getattr(self.wrapped, "on_train_batch_start", None)
        if start_batch is not None:
            with self.calling("on_train_batch_start()"):
                start_batch()
        with self.calling("optimizer.zero_grad()"):
            self.optimizer.zero_grad(set_to_none=s.set_to_none)
        for micro in range(s.accumulate):
            batch = self.workload.batch((step - 1) * s.accumulate + micro + 1, ws)
            last = micro == s.accumulate - 1
            with nullcontext() if last else self.wrapped.no_sync():
                shard = batch.shard(ctx.rank, ws).to(ctx.device)
                with self.calling("the forward"), record_function("forward"):
                    loss = self.workload.loss(self.wrapped, shard) / s.accumulate
                with self.calling("the backward"), record_function("backward"):
                    loss.backward()
                step_loss += loss.detach()
            self._call("after_backward", step, micro, batch)
        finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        if finish is not None:
            with self.calling("finish_gradient_synchronization()"), record_function("grad_sync"):
                finish()
        self._call("after_sync", step)
        with self.calling("optimizer.step()"), record_function("optimizer_step"):
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        self._call("after_step", step)
        if step == s.round_trip_step:
            self.reload(step)
        return step_loss

    def reload(self, step: int) -> None:
        """The optimizer state_dict round trip (`checkpoint.round_trip`), scheduler included,
        after the model's (`model_state.model_round_trip`: a fresh model and wrapper) with
        `round_trip_model`. A failure is reported to the hooks and training goes on from a
        fresh optimizer (and, when the model's failed, the fresh model as it was built)."""
        sched_state = self.scheduler.state_dict() if self.scheduler is not None else None
        error = None
        model_note = ""
        try:
            if self.spec.round_trip_model:
                played = model_state.model_round_trip(
                    self.wrapped,
                    self._rebuild,
                    rank=self.ctx.rank,
                    world_size=self.ctx.world_size,
                    device=self.ctx.device,
                )
                self.model, self.wrapped = played.model, played.wrapped
                model_note = f"; the model's as {played.kind}: {played.note}"
            self.round_trip = checkpoint.round_trip(
                self.optimizer,
                lambda: self._make_optimizer()[0],
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                device=self.ctx.device,
                param_numels=self.param_numels,
                sharded_params=hasattr(self.wrapped, "full_parameters"),
            )
            optimizer = self.round_trip.optimizer
            if model_note:
                note = self.round_trip.note + model_note
                self.round_trip = dataclasses.replace(self.round_trip, note=note)
        except checkpoint.CheckpointError as exc:
            error = exc
            optimizer = self._make_optimizer()[0]  # state lost: both sides restart
        self.optimizer, self.scheduler = optimizer, None
        if sched_state is not None:
            # After the optimizer: loading it restores each group's lr, which a new
            # scheduler's construction would otherwise have reset.
            self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=SCHEDULER_GAMMA)
            self.scheduler.load_state_dict(sched_state)
        self.loaded_after = step
        self._call("after_load", step, error)

    def _call(self, name: str, *args) -> None:
        with self._quiet():
            for hook in self.hooks:
                getattr(hook, name)(self, *args)

    @contextlib.contextmanager
    def calling(self, what: str) -> Iterator[None]:
        """Say what the tool was doing if the code under test raises inside (module doc)."""
        try:
            yield
        except Exception as exc:
            if isinstance(exc, InterfaceError):
                raise
            if call_mismatch(exc):
                raise InterfaceError(call_message(self.spec.impl, what, exc)) from exc
            exc.add_note(f"while ddp-verify ran {self.describe(what)}")
            # What the failure's hint reads (`RankReport.raised`): the call, and whether the
            # class shards its parameters (a freed one then is the usual cause of a raise).
            sharded = hasattr(self.wrapped, "full_parameters")
            exc.ddp_verify = {"call": what, "parameters_sharded": sharded}
            raise

    def describe(self, what: str) -> str:
        """`optimizer.step() at step 2, the first step after loading the optimizer's state`."""
        when = f" at step {self.step_no}" if self.step_no else ""
        if self.loaded_after is not None and self.step_no == self.loaded_after + 1:
            when += ", the first step after the optimizer state_dict round trip"
        return what + when


def _plain(params, optimizer_cls, **defaults) -> torch.optim.Optimizer:
    return optimizer_cls(params, **defaults)
