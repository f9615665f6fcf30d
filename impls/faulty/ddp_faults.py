"""Broken DDP wrappers: the average, the construction broadcast, and what the hooks launch.

Each class changes one method of a correct built-in (`naive.py`, `overlap.py`, `base.py`).
The line that is wrong carries a `# BUG:` comment.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from impls.base import broadcast_coalesced
from impls.naive import NaiveDDP
from impls.overlap import OverlapDDP

from .catalogue import fault

# --- the average ---------------------------------------------------------------------------


@fault("no-divide", caught_by="equivalence", shows_on=("world-2",))
class SumsWithoutDividing(NaiveDDP):
    """Sums the gradients over ranks and never divides by the world size.

    Symptom: every rank holds the same gradient, N times the average, so the replicas stay
    bitwise identical (consistency passes). With SGD every step is N times too large; with
    AdamW, which divides by the gradient's running RMS, the updates barely change (only
    epsilon and weight decay tell), so the loss curve looks fine.

    Only a comparison with one process sees it: equivalence, at the first gradient check.
    """

    def _finish_synchronization(self) -> None:
        used = self._globally_used()
        for index, param in enumerate(self.sync_params):
            if used[index]:
                grad = self._local_grad(index)
                dist.all_reduce(grad, group=self.process_group)  # BUG: no division
                self._set_grad(param, grad)


@fault("divide-by-two", caught_by="equivalence", shows_on=("world-1",))
class DividesByTwo(NaiveDDP):
    """Divides the summed gradients by a hard-coded 2, not by the world size.

    Symptom: right on exactly 2 ranks (the only world size many people test), wrong on 1, 3
    or 4 ranks: gradients are N/2 times the average. The ranks agree (consistency passes).

    Caught by equivalence on any world size but 2 (the matrix runs 1, 2, 3 and 4 ranks); the
    detection matrix uses 1, the cheapest.
    """

    def _finish_synchronization(self) -> None:
        used = self._globally_used()
        for index, param in enumerate(self.sync_params):
            if used[index]:
                grad = self._local_grad(index)
                dist.all_reduce(grad, group=self.process_group)
                grad.div_(2)  # BUG: the world size, hard-coded
                self._set_grad(param, grad)


@fault("zero-grad-for-unused", caught_by="equivalence", shows_on=("unused-everywhere",))
class ZeroGradForUnused(NaiveDDP):
    """Gives every parameter a gradient, zeros where no rank computed one (the usual fix for
    a hang on unused parameters), instead of leaving `.grad` as None.

    Symptom: the replicas agree, but a parameter no rank used gets a zero gradient where one
    process has None; AdamW then still moves it (weight decay, and the decaying moments of
    earlier steps), which training on one process never does.

    Caught by equivalence on the workload with unused parameters (the gradient is zeros where
    the reference's is None, and the parameter moves).
    """

    def _globally_used(self) -> list[bool]:
        return [True] * len(self.sync_params)  # BUG: "used" everywhere, so zeros, never None


# --- the construction broadcast ------------------------------------------------------------


@fault("average-at-construction", caught_by="equivalence", shows_on=("world-2",))
class AveragesAtConstruction(NaiveDDP):
    """Averages the replicas' initial parameters and buffers instead of broadcasting rank 0's.

    Symptom: every replica starts from the same weights, so the replicas agree bitwise at every
    step (consistency passes), but those weights are a blend no single model was initialized
    to: the run is not the run of the model the user built and seeded (rank 0's), and the
    blend of independently initialized weights has a smaller scale than any of them.

    Caught by equivalence at construction: the reference is built from rank 0's seed, and a
    broadcast copies bits, so the parameters must equal it exactly.
    """

    def _sync_module_states(self) -> None:
        for tensor in [p.data for p in self.module.parameters()] + list(self.module.buffers()):
            if tensor.is_floating_point():
                dist.all_reduce(tensor, group=self.process_group)  # BUG: average, not broadcast
                tensor.div_(self.world_size)
            else:
                dist.broadcast(tensor, src=dist.get_global_rank(self.process_group, 0))


@fault("no-buffer-broadcast", caught_by="consistency", shows_on=("buffers",))
class ForgetsBuffers(NaiveDDP):
    """Broadcasts parameters at construction but not buffers (and not before each forward).

    Symptom: buffers that differ between ranks from the start (a random offset, running
    statistics) stay different: each replica computes a different function, and the
    gradients it contributes are gradients of a model the other ranks do not have.

    Caught by consistency at the first audit (construction): the buffers differ between ranks.
    """

    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__(module, broadcast_buffers=False, **kwargs)

    def _sync_module_states(self) -> None:
        # BUG: buffers are left out.
        broadcast_coalesced([p.data for p in self.module.parameters()], self.process_group)


@fault("frozen-not-broadcast", caught_by="consistency", shows_on=("frozen",))
class SkipsFrozenParameters(NaiveDDP):
    """Broadcasts only the parameters that require gradients at construction.

    Symptom: a frozen layer keeps each rank's own random initialization. Nothing ever
    synchronizes it, so each replica is a different model, and the trainable parameters before
    the frozen layer get gradients of different functions on different ranks.

    Caught by consistency at construction: the frozen parameters differ between ranks.
    """

    def _sync_module_states(self) -> None:
        # BUG: only the trainable ones; frozen parameters keep each rank's initialization.
        trainable = [p.data for p in self.module.parameters() if p.requires_grad]
        broadcast_coalesced(trainable + list(self.module.buffers()), self.process_group)


# --- what the hooks launch -----------------------------------------------------------------


@fault("reduces-parameter", caught_by="consistency", shows_on=("world-2",))
class ReducesTheParameter(OverlapDDP):
    """The gradient hook all-reduces the parameter it receives instead of its `.grad`
    (picotron's naive DDP had exactly this bug).

    Symptom: the parameters, already equal, are averaged with themselves (harmless); the
    gradients are never averaged, so each rank steps with its own gradient and the replicas
    drift apart from the first step.

    Caught by consistency at the first gradient audit: the gradients differ between ranks.
    """

    def _launch(self, unit: int) -> tuple[dist.Work | None, object]:
        (index,) = self.units[unit]
        param = self.sync_params[index]
        param.data.div_(self.world_size)
        handle = self._all_reduce_async(param.data)  # BUG: the parameter, not param.grad
        return handle, self._local_grad(index)


@fault("handles-never-cleared", caught_by="equivalence", shows_on=("world-2",))
class NeverClearsHandles(OverlapDDP):
    """Never clears its list of launched all-reduces between steps.

    Symptom: from the second step on, `finish_gradient_synchronization()` walks the handles
    of every earlier step too and writes each one's (stale) averaged gradient over this
    step's: the optimizer steps on old gradients where this rank produced new ones, and
    memory grows every step.

    Caught by equivalence at step 2 (the stale gradients are the same on every rank, so the
    replicas mostly agree).
    """

    def _reset(self) -> None:
        launched = getattr(self, "_in_flight", [])
        super()._reset()
        self._in_flight = launched  # BUG: should start empty every step


@fault("arrival-order", caught_by="consistency", shows_on=("unused-everywhere",))
class LaunchesInArrivalOrder(OverlapDDP):
    """Launches each gradient's all-reduce the moment it is ready, in the order gradients
    arrive, instead of in the fixed order every rank shares.

    Symptom: fine while every rank computes gradients for the same parameters in the same
    order. When a parameter is used on one rank only, that rank's k-th all-reduce carries a
    different tensor than the others' k-th: gradients of different parameters are silently
    added together when the sizes match, and gloo aborts or hangs when they do not.

    Caught by consistency (a rank fails, or the mixed gradients differ between ranks) on the
    workload whose `one_rank` branch runs on rank 0 only: gloo aborts with "Received data size
    doesn't match expected size", and the launcher's collective trace names the mismatch.
    """

    def _launch_ready_units(self, *, force: bool = False) -> None:
        launched = {unit for unit, _, _ in self._in_flight}
        # BUG: every ready unit goes now; earlier units in the shared order are not waited for.
        for unit in range(len(self.units)):
            if unit not in launched and (force or self._missing[unit] == 0):
                self._in_flight.append((unit, *self._launch(unit)))


__all__ = [
    "AveragesAtConstruction",
    "DividesByTwo",
    "ForgetsBuffers",
    "LaunchesInArrivalOrder",
    "NeverClearsHandles",
    "ReducesTheParameter",
    "SkipsFrozenParameters",
    "SumsWithoutDividing",
    "ZeroGradForUnused",
]
