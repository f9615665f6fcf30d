"""Overlapped data parallelism: each gradient's all-reduce starts during backward.

What is communicated, when, and at what cost:
- during `backward()`: as soon as a parameter's gradient is fully accumulated (a
  `register_post_accumulate_grad_hook`), it is divided by the world size and an *async*
  all-reduce of it is launched, so communication of late layers overlaps the backward
  computation of early ones;
- in `finish_gradient_synchronization()`: launch whatever has not been launched (gradients this
  rank did not produce, as zeros), all-reduce the usage map, wait on every handle;
- collectives per step: P + 1 for P trainable parameter tensors; no extra memory (gradients are
  reduced in place).

The idea it adds to `naive`: communication hidden behind backward. The rule that keeps it
correct: launch order is fixed (reverse registration order) and identical on every rank. Units
are launched strictly in that order, as DDP's Reducer launches buckets: a gradient that arrives
early waits for those before it. If each rank launched in arrival order, a parameter used on one
rank only would make that rank's k-th collective a different tensor from everyone else's,
silently mixing gradients of different parameters or hanging on a size mismatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallel


class OverlapDDP(DataParallel):
    """Async all-reduce per gradient, launched from gradient hooks in a fixed order.

    Subclasses change the unit of communication by overriding `_plan_units`, `_launch` and
    `_complete` (see `bucketed.py`).
    """

    def __init__(self, module: nn.Module, **kwargs) -> None:
        """Same arguments as `DataParallel` (`process_group=`, `broadcast_buffers=`)."""
        super().__init__(module, **kwargs)
        # Units in launch order; each is a list of indices into self.sync_params.
        self.units = self._plan_units()
        self._unit_of = {i: u for u, unit in enumerate(self.units) for i in unit}
        self._reset()

    def _plan_units(self) -> list[list[int]]:
        # Reverse registration order approximates the order backward produces gradients.
        return [[i] for i in reversed(range(len(self.sync_params)))]

    def _reset(self) -> None:
        self._missing = [len(unit) for unit in self.units]  # gradients not yet ready, per unit
        self._next_unit = 0  # every unit before this one has been launched
        self._in_flight: list[tuple[int, dist.Work | None, object]] = []

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        unit = self._unit_of[index]
        if unit < self._next_unit:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter got a gradient after its all-reduce was "
                "launched; call backward once per synchronized step (use no_sync() to accumulate)"
            )
        self._missing[unit] -= 1
        self._launch_ready_units()

    def _launch_ready_units(self, *, force: bool = False) -> None:
        """Launch, in order, every unit whose gradients are all ready (all of them if `force`)."""
        while self._next_unit < len(self.units) and (force or self._missing[self._next_unit] == 0):
            unit = self._next_unit
            with torch.profiler.record_function(f"{type(self).__name__}.launch[{unit}]"):
                handle, payload = self._launch(unit)
            self._in_flight.append((unit, handle, payload))
            self._next_unit += 1

    def _launch(self, unit: int) -> tuple[dist.Work | None, object]:
        """Start the all-reduce of `unit`; returns its handle and what `_complete` needs."""
        (index,) = self.units[unit]
        grad = self._local_grad(index)
        grad.div_(self.world_size)
        return self._all_reduce_async(grad), grad

    def _complete(self, unit: int, payload: object, used: list[bool]) -> None:
        """Write the averaged result of a finished unit into `.grad` of globally used params."""
        (index,) = self.units[unit]
        if used[index]:
            self._set_grad(self.sync_params[index], payload)

    def _all_reduce_async(self, tensor: torch.Tensor) -> dist.Work | None:
        if self.world_size == 1:
            return None
        return dist.all_reduce(tensor, group=self.process_group, async_op=True)

    def _finish_synchronization(self) -> None:
        # Units whose gradients this rank did not produce are launched now, still in order.
        self._launch_ready_units(force=True)
        # After every gradient collective, so it sits at the same place on every rank.
        used = self._globally_used()
        name = type(self).__name__
        for unit, handle, _ in self._in_flight:
            with torch.profiler.record_function(f"{name}.wait[{unit}]"):
                if handle is not None:
                    handle.wait()
        # Results are written back only once nothing is on the wire: on a CPU the copies
        # would compete with the collectives still in flight for cores and memory bandwidth.
        with torch.profiler.record_function(f"{name}.write_back"):
            for unit, _, payload in self._in_flight:
                self._complete(unit, payload, used)
        self._reset()
