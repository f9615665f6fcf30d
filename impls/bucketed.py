"""Bucketed data parallelism: gradients travel in buckets of at most `bucket_size_mb`.

What is communicated, when, and at what cost:
- during `backward()`: gradients are grouped (per device and dtype) into buckets planned once at
  construction (`planning.plan_buckets`, reverse registration order). Each `Bucket` owns one
  flat buffer, and every member's `.grad` is a view into it (PyTorch DDP's
  `gradient_as_bucket_view=True`). When a bucket's last gradient is ready its gradients are
  divided by the world size in place, and one async all-reduce of the buffer is launched;
  buckets launch strictly in plan order (see `overlap.py` for why). A `.grad` that autograd
  made afresh (after `zero_grad(set_to_none=True)`, the default) is divided into its view on
  the way in (one pass);
- in `finish_gradient_synchronization()`: launch buckets not yet launched (gradients this rank
  did not produce are zeros), all-reduce the usage map, wait on every bucket, and make each
  view the `.grad` of its parameter where it is not yet: nothing is copied back;
- collectives per step: B + 1 for B buckets; extra memory: none in steady state (the buffers
  are the gradients). After `zero_grad(set_to_none=True)` autograd makes fresh gradients that
  live until the synchronization, as with any wrapper.

The idea it adds to `overlap`: amortize per-collective latency over many small gradients while
keeping most of the overlap. `bucket_size_mb` trades the two: one huge bucket is `flat` with no
overlap; a tiny one is `overlap`.

What `.grad` is after a synchronization: the bucket view, for every parameter some rank used
(the tensor object the user had is not kept: write to it, do not hold on to it across steps;
inside `no_sync()` autograd accumulates into it in place). A parameter no rank used keeps its
`.grad` untouched (None stays None; an old gradient keeps its values).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .overlap import OverlapDDP
from .planning import ParamInfo, plan_buckets


class Bucket:
    """One flat gradient buffer, a view of it per member parameter (its `.grad` from the
    first synchronization on), and the handle of the all-reduce of the buffer in flight.

    The buffer is the collective's from `launch` to `wait`: while a handle is held, nothing
    reads or writes it, nor a `.grad` that is one of its views (what `--sanitize` checks:
    views share the buffer's storage, so it sees every access).
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.handle: dist.Work | None = None

    def fill(self, produced: list[bool], divide_by: int) -> None:
        """Put each member's gradient, divided by `divide_by`, in its view; a member not
        `produced` on this rank contributes zeros.

        A gradient already in its view (every step but the first with `set_to_none=False`,
        every micro-step after the first under `no_sync()`) is divided in place: no copy. A
        fresh one stays `.grad` until `attach`: its view becomes `.grad` only once the average
        is in it, so whatever writes that `.grad` meanwhile (a buggy subclass's late gradient)
        writes the fresh tensor, not memory on the wire.
        """
        for param, view, mine in zip(self.params, self.views, produced, strict=True):
            grad = param.grad
            if mine and grad is not None:
                if _is_view(grad, view):
                    view.div_(divide_by)
                else:  # fresh: the division rides on the copy (one pass, same rounding)
                    torch.div(grad, divide_by, out=view)
            else:
                if grad is not None and _is_view(grad, view):
                    # An old gradient in the view: the view must carry zeros, and if no rank
                    # used the parameter its `.grad` must come out untouched.
                    param.grad = view.clone()
                view.zero_()

    def launch(self, all_reduce) -> dist.Work | None:
        """Start the all-reduce of the buffer with `all_reduce` (async; None on one rank)."""
        self.handle = all_reduce(self.buffer)
        return self.handle

    def wait(self) -> None:
        """Wait for the all-reduce in flight, if one is: the views hold the average after."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def attach(self, used: list[bool]) -> None:
        """Make each view the `.grad` of its member if some rank `used` it (after `wait`)."""
        for param, view, anywhere in zip(self.params, self.views, used, strict=True):
            if anywhere and not (param.grad is not None and _is_view(param.grad, view)):
                param.grad = view


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """`grad` is `view`'s memory (the same object, or one the user re-made over it)."""
    return grad is view or (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape)


class BucketedDDP(OverlapDDP):
    """Bucketed async all-reduce launched from gradient hooks (see module docstring).

    Args:
        module: the model replica on this rank.
        bucket_size_mb: the most gradient bytes a bucket holds, in MiB (a parameter larger
            than this gets a bucket of its own). Same meaning as DDP's `bucket_cap_mb`.
            None: no cap, one bucket per (device, dtype), as the course's interface allows.
        process_group: the group gradients are averaged over (default: the world group).
        broadcast_buffers: broadcast buffers from rank 0 before every forward.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_size_mb: float | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.bucket_size_mb = bucket_size_mb  # read by _plan_units during super().__init__
        super().__init__(module, process_group=process_group, broadcast_buffers=broadcast_buffers)

    def _bucket_plan(self) -> list[list[int]]:
        """Indices into `sync_params`, bucket by bucket, in launch order (`plan_buckets`)."""
        infos = [
            ParamInfo(nbytes=p.numel() * p.element_size(), group=(p.device, p.dtype))
            for p in self.sync_params
        ]
        return plan_buckets(infos, self.bucket_size_mb)

    def _plan_units(self) -> list[list[int]]:
        plan = self._bucket_plan()
        self.buckets = [Bucket([self.sync_params[i] for i in unit]) for unit in plan]
        return plan

    def _launch(self, unit: int) -> tuple[dist.Work | None, object]:
        bucket = self.buckets[unit]
        bucket.fill([self._locally_used[i] for i in self.units[unit]], self.world_size)
        return bucket.launch(self._all_reduce_async), bucket

    def _complete(self, unit: int, payload: object, used: list[bool]) -> None:
        payload.wait()  # done already (the base waits on every handle first)
        payload.attach([used[i] for i in self.units[unit]])
