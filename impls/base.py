"""The lifecycle every data-parallel variant shares; variants differ only in *when* and *how*
gradients are communicated.

Contract of a wrapper built on `DataParallel` (the interface course assignments and PyTorch's
`DistributedDataParallel` use):

1. Construction broadcasts every parameter *and buffer* of the wrapped module from rank 0, so
   replicas start bitwise identical whatever seed each rank used. It is a collective: construct
   the wrapper on all ranks in the same order, or training hangs.
2. `forward` runs the wrapped module. With `broadcast_buffers=True` (the default, as in
   PyTorch DDP) it first broadcasts buffers from rank 0, so running statistics that each rank
   updates from its own data do not drift apart.
3. `loss.backward()` accumulates local gradients (variants that overlap communication launch
   it from gradient hooks here).
4. `finish_gradient_synchronization()` must be called after `backward()` and before
   `optimizer.step()`: on return every trainable parameter's `.grad` is the average over ranks.
   A parameter that produced no gradient on some ranks counts as a zero gradient there; a
   parameter that produced none on *any* rank keeps its `.grad` untouched (None stays None),
   exactly as PyTorch DDP does, so optimizers skip it the same way.
5. Inside `with wrapper.no_sync():` nothing is communicated; gradients accumulate locally and
   the first backward outside the block synchronizes the accumulated sum.

Which parameters were used is tracked by a post-accumulate-grad hook on every trainable
parameter, and agreed on with one small all-reduce of a usage map per synchronized step (what
DDP does with `find_unused_parameters=True`). It is always on because a correct answer for
parameters unused on some ranks is part of this project's contract, and it costs one
all-reduce of a few bytes per parameter tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


def sync_module_states(module: nn.Module, process_group: dist.ProcessGroup) -> None:
    """Broadcast all parameters and buffers of `module` from rank 0 of `process_group`.

    Frozen parameters are included: a replica that differs in a frozen weight computes
    different gradients for everything upstream of it.
    """
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    broadcast_coalesced(tensors, process_group)


def broadcast_coalesced(tensors: list[torch.Tensor], process_group: dist.ProcessGroup) -> None:
    """Broadcast `tensors` from group rank 0 in place, one collective per (device, dtype)."""
    if not tensors or dist.get_world_size(process_group) == 1:
        return
    src = dist.get_global_rank(process_group, 0)
    for group in group_by_device_dtype(tensors):
        flat = torch._utils._flatten_dense_tensors(group)
        dist.broadcast(flat, src=src, group=process_group)
        for t, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
            t.copy_(synced)


def group_by_device_dtype(items: list, tensor_of=lambda item: item) -> list[list]:
    """Split `items` into lists whose tensors share device and dtype, in order of first
    appearance; `tensor_of` maps an item to its tensor (items may be indices)."""
    groups: dict[tuple[torch.device, torch.dtype], list] = {}
    for item in items:
        t = tensor_of(item)
        groups.setdefault((t.device, t.dtype), []).append(item)
    return list(groups.values())


class DataParallel(nn.Module):
    """Base of the built-in variants: broadcast at construction, forward, usage tracking,
    `no_sync()`, and the `finish_gradient_synchronization()` entry point.

    Args:
        module: the model replica on this rank.
        process_group: the group gradients are averaged over (default: the world group).
        broadcast_buffers: broadcast buffers from rank 0 before every forward, as PyTorch DDP
            does by default.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self._sync_module_states()

        # module.parameters() yields a tied parameter once, so each gradient is reduced once.
        self.sync_params = [p for p in module.parameters() if p.requires_grad]
        self._locally_used = [False] * len(self.sync_params)
        # A weak reference keeps the hooks (owned by the parameters) from keeping the wrapper
        # alive after the user drops it.
        self_ref = weakref.ref(self)
        for index, param in enumerate(self.sync_params):
            param.register_post_accumulate_grad_hook(_make_hook(self_ref, index))

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            broadcast_coalesced(list(self.module.buffers()), self.process_group)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside communicate nothing."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Average gradients over ranks; call after `backward()`, before `optimizer.step()`.

        A collective: every rank must call it after every synchronized backward, or training
        hangs. A no-op inside `no_sync()`.
        """
        if not self.require_backward_grad_sync:
            return
        with torch.profiler.record_function(f"{type(self).__name__}.finish_sync"):
            self._finish_synchronization()
        self._locally_used = [False] * len(self.sync_params)

    # --- what variants provide -------------------------------------------------------------

    def _sync_module_states(self) -> None:
        """Start every replica from rank 0's parameters and buffers (a collective)."""
        sync_module_states(self.module, self.process_group)

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Called in backward when `param`'s gradient is fully accumulated (synced steps only)."""

    def _finish_synchronization(self) -> None:
        raise NotImplementedError

    # --- helpers for variants --------------------------------------------------------------

    def _local_grad(self, index: int) -> torch.Tensor:
        """The gradient this rank contributes: its own if the parameter was used since the last
        synchronization, else zeros (a stale `.grad` from an earlier step must not leak in)."""
        param = self.sync_params[index]
        if self._locally_used[index] and param.grad is not None:
            return param.grad
        return torch.zeros_like(param)

    def _globally_used(self) -> list[bool]:
        """All-reduce the usage map: which parameters produced a gradient on any rank.

        Must be issued at the same point of the collective sequence on every rank: after every
        gradient collective of the step has been launched.
        """
        if self.world_size == 1:
            return list(self._locally_used)
        device = self.sync_params[0].device if self.sync_params else torch.device("cpu")
        used = torch.tensor(self._locally_used, dtype=torch.int32, device=device)
        dist.all_reduce(used, group=self.process_group)
        return [bool(u) for u in used.tolist()]

    @staticmethod
    def _set_grad(param: nn.Parameter, value: torch.Tensor) -> None:
        """Write an averaged gradient, reusing an existing `.grad` (keeps `set_to_none=False`
        semantics: the user's gradient tensor object survives)."""
        if param.grad is None:
            param.grad = value.view_as(param).clone()
        elif param.grad.data_ptr() != value.data_ptr():
            param.grad.copy_(value.view_as(param))


def _make_hook(self_ref: weakref.ref, index: int):
    def hook(param: nn.Parameter) -> None:
        wrapper = self_ref()
        if wrapper is None:
            return
        wrapper._locally_used[index] = True
        if wrapper.require_backward_grad_sync:
            wrapper._on_grad_ready(index, param)

    return hook
