"""Hang and desync scenarios: DDP wrappers that go wrong on purpose, one way each.

Deliberately broken, like the faulty catalogue next door, but for the hang check: each is
listed in `SCENARIOS`, from which `impls.registry` builds the `hang:<name>` implementations
(kind "hang"), so `python -m verify hang --impl hang:skip-collective` shows what a diagnosis
looks like and the tests prove each is caught. Every scenario is the same small DDP
(broadcast at construction; in `finish_gradient_synchronization()` one blocking all-reduce per
gradient, then an all-reduce of a "gradients are finite" flag, as training loops do before
stepping), with one fault injected on the last rank at the second synchronized step, so the
first step's collectives give the diagnosis a history to compare against:

| scenario | the last rank, at step 2 | what happens on gloo |
|---|---|---|
| skip-collective | skips the finite-flag all-reduce | hang, or a size-mismatch abort |
| bucket-order | rebuilds its buckets in reverse order after step 2 | size-mismatch abort or hang |
| shape-mismatch | all-reduces one gradient with an extra element | abort or hang |
| broadcast-source | re-syncs a parameter broadcasting from itself, not rank 0 | hang (both send) |
| reduce-op | reduces the finite flag with MAX instead of SUM | completes: a desync |
| shape-desync | all-reduces a gradient flattened (same element count) | completes: a desync |
| raise | raises before its all-reduces | the others wait, the launcher ends them |
| sigkill | SIGKILLs itself | the others wait, the launcher ends them |
| deadlock | waits on an event nobody sets (outside any collective) | hang |
| skip-reduce-scatter | (ZeRO-3) skips one unit's reduce-scatter in backward | abort or hang |
| slow-rank | sleeps half the stall timeout, then continues | must NOT be flagged |
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from impls.bucketed import BucketedDDP
from impls.zero3 import Zero3DDP

FAULT_STEP = 2
STALL_ENV = "DDP_VERIFY_STALL_TIMEOUT"  # set by the launcher (and the hang check) in every rank
_fault_model: int | None = None  # id of the wrapper whose step 2 is faulty in this process


class ScenarioDDP(nn.Module):
    """The healthy base: per-gradient blocking all-reduce plus a finite-flag all-reduce."""

    def __init__(self, module: nn.Module, *, process_group=None, **_hints) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.steps = 0
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0, group=self.process_group)
        self.params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def faulty(self) -> bool:
        return _faulty_now(self)

    def finish_gradient_synchronization(self) -> None:
        self.steps += 1
        self.before_sync()
        for i, p in enumerate(self.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(self.world_size)
            self.reduce_grad(i, p.grad)
        self.check_finite()

    # --- what scenarios override ---

    def before_sync(self) -> None:
        pass

    def reduce_grad(self, index: int, grad: torch.Tensor) -> None:
        dist.all_reduce(grad, group=self.process_group)

    def check_finite(self, op=dist.ReduceOp.SUM) -> None:
        dist.all_reduce(nonfinite_count(self.params), op=op, group=self.process_group)


def _faulty_now(wrapper) -> bool:
    """True on the last rank at the fault step of the first model it wraps (never at world
    size 1): the fault happens once per process, however many workloads follow."""
    global _fault_model
    ws, rank = wrapper.world_size, wrapper.rank
    if ws == 1 or rank != ws - 1 or wrapper.steps != FAULT_STEP:
        return False
    if _fault_model is None:
        _fault_model = id(wrapper)
    return _fault_model == id(wrapper)


def nonfinite_count(params: list[nn.Parameter]) -> torch.Tensor:
    """How many of `params` have a gradient with a NaN or an inf, as a 1-element float32 tensor
    on the gradients' device: NCCL takes device tensors only, and counting there needs no host
    sync (a sync per parameter would let a rank spin on the GPU behind a missing collective)."""
    finite = torch.stack([torch.isfinite(p.grad).all() for p in params])
    return (~finite).sum(dtype=torch.float32).reshape(1)


class SkipCollective(ScenarioDDP):
    def check_finite(self, op=dist.ReduceOp.SUM) -> None:
        if self.faulty:
            return  # e.g. an early `return` on a rank-local condition
        super().check_finite(op)


class ShapeMismatch(ScenarioDDP):
    def reduce_grad(self, index, grad) -> None:
        if self.faulty and index == 0:
            padded = torch.cat([grad.flatten(), grad.new_zeros(1)])
            dist.all_reduce(padded, group=self.process_group)
            grad.copy_(padded[:-1].view_as(grad))
            return
        super().reduce_grad(index, grad)


class ShapeDesync(ScenarioDDP):
    def reduce_grad(self, index, grad) -> None:
        if self.faulty and index == 0 and grad.dim() > 1:
            flat = grad.flatten()  # same elements, different shape: gloo does not mind
            dist.all_reduce(flat, group=self.process_group)
            grad.copy_(flat.view_as(grad))
            return
        super().reduce_grad(index, grad)


class ReduceOpMismatch(ScenarioDDP):
    def check_finite(self, op=dist.ReduceOp.SUM) -> None:
        super().check_finite(dist.ReduceOp.MAX if self.faulty else op)


class BroadcastSource(ScenarioDDP):
    def before_sync(self) -> None:
        # "Re-sync the first parameter from rank 0", but the last rank names itself.
        src = self.rank if self.faulty else 0
        dist.broadcast(self.params[0].data, src=src, group=self.process_group)


class Raises(ScenarioDDP):
    def before_sync(self) -> None:
        if self.faulty:
            raise RuntimeError(f"rank {self.rank} hit a data error at step {self.steps}")


class Killed(ScenarioDDP):
    def before_sync(self) -> None:
        if self.faulty:
            os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does


class Deadlock(ScenarioDDP):
    def before_sync(self) -> None:
        if self.faulty:
            threading.Event().wait()  # a lock of its own that nobody releases


class SlowRank(ScenarioDDP):
    def before_sync(self) -> None:
        if self.faulty:
            stall = float(os.environ.get(STALL_ENV, "2"))
            time.sleep(stall / 2)  # slow, not hung: the watchdog must not flag this


class ReversedBuckets(BucketedDDP):
    """BucketedDDP whose last rank rebuilds its buckets in the reverse order after step 2, as a
    wrapper does that re-plans buckets from each rank's own gradient arrival order (PyTorch DDP
    rebuilds its buckets after the first iteration, from an order it agrees on first)."""

    def __init__(self, module, *, bucket_size_mb: float | None = 25.0, **kwargs) -> None:
        # Small buckets, so that there are several of different sizes (even when asked for one).
        small = 0.002 if bucket_size_mb is None else min(bucket_size_mb, 0.002)
        super().__init__(module, bucket_size_mb=small, **kwargs)
        self.steps = 0

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        self.steps += 1
        global _fault_model
        ws = dist.get_world_size(self.process_group)
        # After step 2, so that two steps of history show which rank changed its order.
        if self.steps != FAULT_STEP or ws == 1 or self.rank_in_group() != ws - 1:
            return
        if _fault_model not in (None, id(self)):
            return  # once per process
        _fault_model = id(self)
        self.units, self.buckets = self.units[::-1], self.buckets[::-1]
        self._unit_of = {i: u for u, unit in enumerate(self.units) for i in unit}
        self._reset()

    def rank_in_group(self) -> int:
        return dist.get_rank(self.process_group)


class SkipReduceScatter(Zero3DDP):
    """ZeRO-3 whose last rank, in step 2's backward, skips the reduce-scatter of the first unit
    whose backward completes (as a rank-local early return would) and keeps zeros as its
    gradient shard: the other ranks wait in that reduce-scatter for a rank that went on.
    (No `__init__` of its own: the registry reads `Zero3DDP`'s, whose `find_unused_parameters`
    makes it refuse the workload with a branch used on one rank, as `zero3` does.)"""

    steps = 0  # synchronized forwards so far (instances count their own)
    _skipped_at: int | None = None

    def forward(self, *args, **kwargs):
        if self.require_backward_grad_sync:
            self.steps += 1  # a synchronized step's forward: step 2's backward follows
        return super().forward(*args, **kwargs)

    def _reduce_scatter(self, unit) -> None:
        if _faulty_now(self) and self._skipped_at is None:
            self._skipped_at = self.steps
            unit.used = [False] * len(unit.leaves)  # no reduce-scatter: nothing to wait on
            unit.reduced = unit.full.new_zeros(unit.total)
            for leaf in unit.leaves:
                leaf.grad = None
            return
        super()._reduce_scatter(unit)


#: name -> (class, summary, what the hang check must conclude: "hang" | "crash" | "desync" | "ok")
SCENARIOS: dict[str, tuple[type, str, str]] = {
    "hang:skip-collective": (SkipCollective, "last rank skips a collective at step 2", "hang"),
    "hang:bucket-order": (ReversedBuckets, "last rank rebuilds its buckets reversed", "hang"),
    "hang:shape-mismatch": (ShapeMismatch, "last rank all-reduces one extra element", "hang"),
    "hang:broadcast-source": (BroadcastSource, "last rank broadcasts from itself", "hang"),
    "hang:reduce-op": (ReduceOpMismatch, "last rank reduces with MAX, others SUM", "desync"),
    "hang:shape-desync": (ShapeDesync, "last rank reduces a gradient flattened", "desync"),
    "hang:raise": (Raises, "last rank raises at step 2", "crash"),
    "hang:sigkill": (Killed, "last rank is SIGKILLed at step 2", "crash"),
    "hang:deadlock": (Deadlock, "last rank blocks outside any collective", "hang"),
    "hang:skip-reduce-scatter": (
        SkipReduceScatter,
        "zero3's last rank skips a unit's reduce-scatter at step 2",
        "hang",
    ),
    "hang:slow-rank": (SlowRank, "last rank stalls half the stall timeout (not a hang)", "ok"),
}
