"""What a check attaches to the training loop (`trainer.py`): `Hooks`, called on every rank in
the same order at fixed points of a step, and `Progress`, the step-by-step progress line."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verify.training.trainer import Trainer
    from verify.training.workloads import Batch


class Hooks:
    """What a check attaches to the loop; every method is a no-op here. Hooks run on every
    rank in the same order, so they may call collectives."""

    def after_build(self, run: Trainer) -> None:
        """The wrapper and the optimizer are constructed."""

    def before_step(self, run: Trainer, step: int) -> None:
        """Step `step` (from 1) is about to start."""

    def after_backward(self, run: Trainer, step: int, micro: int, batch: Batch) -> None:
        """One micro-batch's backward ran; `batch` is the global batch (every rank's shard)."""

    def after_sync(self, run: Trainer, step: int) -> None:
        """Gradients are synchronized (`finish_gradient_synchronization()` returned)."""

    def after_step(self, run: Trainer, step: int) -> None:
        """The optimizer (and the scheduler) stepped."""

    def after_load(self, run: Trainer, step: int, error: Exception | None) -> None:
        """The optimizer state was saved and reloaded after `step` (`run.round_trip` says
        how), or the round trip failed with `error` and training goes on from a fresh
        optimizer."""


class Progress(Hooks):
    """Rank 0 says each step as it ends (`verify/progress.py` prints it in the parent)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def after_step(self, run: Trainer, step: int) -> None:
        if run.ctx.rank == 0:
            from verify import progress

            progress.say(f"{self.label}: step ", step, run.spec.steps)
