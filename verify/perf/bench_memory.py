"""bench's part 3: the memory of each memory variant, built and stepped once, alone, per rank.

For every variant of `MEMORY_VARIANTS` in the run (the ladder: `bucketed` shards nothing,
`zero1` and `torch-zero` the optimizer state, `zero2` the gradients too, `zero3` and
`torch-fsdp` the parameters too), one trainer with no other alive takes one step under two
hooks that share one way of counting bytes, the memory check's (`verify/checks/memory.py`:
a `DTensor` counts by its local shard, optimizer state by `optim_state.local_state_bytes`):

- `MemoryProbe`: parameter, gradient and optimizer-state bytes after construction, before
  the step (gradients synchronized) and after it, plus, on CUDA, the bytes the live
  tensors requested from the allocator, counted from what was requested before the variant
  was built (CUDA's count holds every live tensor of the process: hence one variant alive
  at a time);
- `MemoryHooks` (the memory check itself): each kind per rank against the unsharded size,
  and whether the rung shards what it promises (`MemoryResult`), put together across ranks.

Every rank calls `memory_alone` at the same point: building a variant and `MemoryHooks.result`
are collectives.
"""

from __future__ import annotations

import gc

import torch

from verify.checks.memory import MemoryHooks, MemoryResult
from verify.launching import RankContext
from verify.perf.bench_result import MEMORY_VARIANTS
from verify.training.hooks import Hooks
from verify.training.trainer import Trainer


class MemoryProbe(Hooks):
    """Tensor bytes of the model, its gradients and its optimizer state after construction,
    and before and after the first optimizer step; on CUDA also the bytes requested since
    `baseline` (what was requested before the trainer was built: `allocated_bytes`)."""

    def __init__(self, baseline: int | None = None) -> None:
        self.baseline = baseline
        self.phases: dict[str, dict] = {}

    def after_build(self, trainer: Trainer) -> None:
        self.phases["after construction"] = _model_state(trainer, self.baseline)

    def after_sync(self, trainer: Trainer, step: int) -> None:
        if step == 1:
            self.phases["before step"] = _model_state(trainer, self.baseline)

    def after_step(self, trainer: Trainer, step: int) -> None:
        if step == 1:
            self.phases["after step"] = _model_state(trainer, self.baseline)


def allocated_bytes(device: torch.device) -> int | None:
    """The bytes every live tensor of this process asked CUDA's allocator for on `device`;
    None off CUDA.

    Requested, not allocated: the caching allocator hands out a cached free block whole when
    it is less than 1 MiB larger than the request (it splits only a larger one), and counts
    the whole block as allocated. What sits in its cache depends on what ran before, so the
    allocated count of one variant moved with the variants benched before it: zero1's 0.5M
    model read 8,388,608 bytes (an 8 MiB block taken whole) after three other variants and
    7,924,224 alone (one H100; 7,459,840 and 8,388,608 the other way round on an H200)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return stats.get("requested_bytes.all.current", stats.get("allocated_bytes.all.current", 0))


def settle(device: torch.device) -> None:
    """Let the tensors of a variant that is gone leave CUDA's count before the next baseline.

    A tensor a collective used on another stream is freed late: the caching allocator holds
    its block until that stream's event completes (record_stream), and the process group
    keeps tensors it stashed until their work is done; one freed during the next variant's
    build would come off that variant's count. gc first, so that the blocks are free; then
    wait for the device and let `empty_cache` process the pending events (it is where the
    allocator does, besides the next allocation). (The 11% a variant's figure once moved by
    with the variants before it was not this but the allocator's whole blocks, which
    `allocated_bytes` leaves out: see there.)"""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _model_state(trainer: Trainer, baseline: int | None) -> dict:
    """This rank's bytes now, counted as the memory check counts them (rank-local: none of
    `MemoryHooks`' collectives runs here)."""
    counted = MemoryHooks()
    counted.after_sync(trainer, trainer.step_no)
    counted.after_step(trainer, trainer.step_no)
    allocated = allocated_bytes(trainer.ctx.device)
    return {
        "params": counted.params,
        "grads": counted.grads,
        "optimizer": counted.state,
        "allocated": None if allocated is None else allocated - (baseline or 0),
    }


def memory_alone(ctx: RankContext, options) -> tuple[dict[str, dict], dict[str, MemoryResult]]:
    """Part 3 (module docstring), for the memory variants among `options.variants` (call it
    when no other trainer is alive): ({variant: {phase: bytes}} of this rank, {variant: the
    memory check's result, the same on every rank})."""
    phases, shards = {}, {}
    for name in MEMORY_VARIANTS:  # in the ladder's order
        if name not in options.variants:
            continue
        settle(ctx.device)
        probe, check = MemoryProbe(allocated_bytes(ctx.device)), MemoryHooks()
        trainer = Trainer(ctx, options.train_spec(name), hooks=(probe, check))
        trainer.step(trainer.step_no + 1)
        shards[name] = check.result(trainer)
        del trainer
        phases[name] = probe.phases
    settle(ctx.device)
    return phases, shards
