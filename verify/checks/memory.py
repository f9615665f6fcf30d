"""The memory check per rung: how much of the model each rank holds, measured, against 1/N.

ZeRO's promise is a ladder of memory (per rank, N ranks): ZeRO-1 shards the optimizer state
(~1/N), ZeRO-2 the gradients too, ZeRO-3 / FSDP the parameters too (outside the unit being
computed). This check measures, on every rank, after training steps:

- parameters: the bytes of the trainable parameters this rank holds (a `DTensor`'s local
  shard; frozen parameters may stay whole: `zero3` leaves them so);
- gradients: the bytes of `.grad` held right after the synchronization (before the step,
  when a rank that keeps every gradient would still hold them all);
- optimizer state: `optim_state.local_state_bytes` (every tensor reachable from the optimizer
  that is neither a parameter nor a gradient; a `DTensor`'s local shard);

and the unsharded size of each (full shapes; the state of a plain optimizer stepped once).
It sits beside `cells.check_shard_sizes` (the matrix's state-only check) and uses the same
bound. A kind counts as sharded when the ranks together hold at most the unsharded bytes (no
tensor kept twice; row sharding may add the padding of each tensor's rows up to a multiple of
N) and the largest rank at most (2 - 1/N) x max(total / N, largest tensor): sound for any
whole-tensor partition (Graham's bound for list scheduling) and for row slices.
Which kinds a rung must shard: `promised`. The matrix's shard cell uses this check for
implementations whose parameters are sharded (`cells.py`); `check_shard_sizes` judges the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verify.training.hooks import Hooks
from verify.training.optim_state import local_state_bytes
from verify.training.plain_state import unsharded_state
from verify.training.sharded import full_parameters
from verify.training.trainer import Trainer

KINDS = ("parameters", "gradients", "state")

#: what each registered sharded rung promises to shard (the ladder of the module docstring)
RUNGS = {
    "zero1": ("state",),
    "torch-zero": ("state",),
    "zero2": ("state", "gradients"),
    "zero3": ("state", "gradients", "parameters"),
    "torch-fsdp": ("state", "gradients", "parameters"),
}


@dataclass(frozen=True)
class KindMemory:
    """One kind (parameters, gradients or state): bytes per rank and unsharded."""

    kind: str
    per_rank: tuple[int, ...]
    unsharded: int
    largest: int  # the largest single tensor's bytes (whole-tensor granularity)
    allowance: int = 0  # bytes every rank may hold beyond its share (replicated scalars)
    padding: int = 0  # bytes row sharding may add: each tensor's rows rounded up to N's multiple

    @property
    def ratios(self) -> tuple[float, ...]:
        """Each rank's bytes over the unsharded total (1/N is a perfect shard)."""
        return tuple(b / self.unsharded if self.unsharded else 0.0 for b in self.per_rank)

    @property
    def limit(self) -> float:
        n = len(self.per_rank)
        return (2 - 1 / n) * max(-(-self.unsharded // n), self.largest)

    @property
    def sharded(self) -> bool:
        n, extra = len(self.per_rank), self.allowance
        return (
            sum(self.per_rank) <= self.unsharded + (n - 1) * extra + self.padding
            and max(self.per_rank) <= self.limit + extra + self.padding
        )

    def describe(self) -> str:
        ratios = ", ".join(f"{r:.2f}" for r in self.ratios)
        return f"{self.kind} per rank / unsharded: {ratios} (1/N = {1 / len(self.per_rank):.2f})"


@dataclass(frozen=True)
class MemoryResult:
    """Every kind measured on every rank, and what the rung promised to shard."""

    kinds: tuple[KindMemory, ...]
    promised: tuple[str, ...]

    @property
    def failures(self) -> tuple[str, ...]:
        return tuple(
            f"{k.describe()}: not sharded"
            for k in self.kinds
            if k.kind in self.promised and not k.sharded
        )

    @property
    def passed(self) -> bool:
        return not self.failures

    def of(self, kind: str) -> KindMemory:
        return next(k for k in self.kinds if k.kind == kind)


class MemoryHooks(Hooks):
    """Measures gradients after each synchronization and the rest after each step (module
    docstring); `result()` is a collective that puts the ranks' last measures together."""

    def __init__(self) -> None:
        self.grads = 0
        self.params = self.state = 0

    def after_sync(self, run: Trainer, step: int) -> None:
        self.grads = sum(_local_bytes(p.grad) for p in run.model.parameters() if p.grad is not None)

    def after_step(self, run: Trainer, step: int) -> None:
        params = [p for p in run.model.parameters() if p.requires_grad]  # frozen: may stay whole
        self.params = sum(_local_bytes(p) for p in params)
        self.state = local_state_bytes(run.optimizer, params).bytes  # a DTensor by its shard

    def snapshot(self, run: Trainer) -> MemoryResult:
        """Measure everything now (after a step: the step's gradients are still held) and
        put the ranks' measures together. A collective."""
        self.after_sync(run, run.step_no)
        self.after_step(run, run.step_no)
        return self.result(run)

    def result(self, run: Trainer) -> MemoryResult:
        mine = (self.params, self.grads, self.state)
        gathered: list = [mine] * run.ctx.world_size
        if run.ctx.world_size > 1:
            dist.all_gather_object(gathered, mine)
        # Unsharded sizes from the whole parameters (a ZeRO-3 module's parameters are shards).
        whole_by_name = full_parameters(run.model, run.wrapped)
        trainable_names = {n for n, p in run.model.named_parameters() if p.requires_grad}
        trainable = [t for n, t in whole_by_name.items() if n in trainable_names]
        params = trainable
        whole = [torch.zeros(p.shape, dtype=p.dtype) for p in trainable]
        plain = unsharded_state(whole) if run.spec.optimizer == "adamw" else []
        if run.spec.optimizer == "sgd":
            plain = unsharded_state(whole, torch.optim.SGD, momentum=0.9)
        state_sizes = [s.bytes for s in plain]
        sizes = {
            "parameters": [_full_bytes(p) for p in params],
            "gradients": [_full_bytes(p) for p in trainable],
            "state": state_sizes,
        }
        # AdamW's `step` is a one-element tensor per parameter that FSDP2 keeps on every rank.
        allowance = {"state": 8 * len(trainable)}
        n = run.ctx.world_size
        fraction = {
            id(t): (n * -(-t.shape[0] // n) - t.shape[0]) / t.shape[0] if t.dim() and len(t) else 0
            for t in params
        }
        tensors = {"parameters": params, "gradients": trainable, "state": trainable}
        padding = {
            k: int(sum(fraction[id(t)] * b for t, b in zip(tensors[k], sizes[k]))) for k in KINDS
        }
        kinds = tuple(
            KindMemory(
                k,
                tuple(g[i] for g in gathered),
                sum(sizes[k]),
                max(sizes[k], default=0),
                allowance.get(k, 0),
                padding[k],
            )
            for i, k in enumerate(KINDS)
        )
        return MemoryResult(kinds, promised(run))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def _full_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a DTensor's numel is the full tensor's


def promised(run: Trainer) -> tuple[str, ...]:
    """What the rung promises to shard: `RUNGS` for a registered name; every kind for any
    other class with `full_parameters()` (it says its parameters are shards, and a plain
    optimizer over shards keeps sharded state); nothing otherwise."""
    if run.spec.impl in RUNGS:
        return RUNGS[run.spec.impl]
    return KINDS if hasattr(run.wrapped, "full_parameters") else ()
