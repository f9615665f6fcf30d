"""Bucketed data parallelism: gradients travel in buckets of at most `bucket_size_mb`.

What is communicated, when, and at what cost:
- during `backward()`: gradients are grouped (per device and dtype) into buckets planned once at
  construction (`planning.plan_buckets`, reverse registration order). When a bucket's last
  gradient is ready, its gradients are copied into the bucket's flat buffer divided by the
  world size (one pass), and one async all-reduce of the buffer is launched; buckets launch
  strictly in plan order (see `overlap.py` for why);
- in `finish_gradient_synchronization()`: launch buckets not yet launched (gradients this rank
  did not produce are zeros), all-reduce the usage map, wait on every bucket, then copy the
  averaged gradients back into `.grad`;
- collectives per step: B + 1 for B buckets; extra memory: one flat buffer per bucket (a copy
  of the gradients), as PyTorch DDP with `gradient_as_bucket_view=False`.

The idea it adds to `overlap`: amortize per-collective latency over many small gradients while
keeping most of the overlap. `bucket_size_mb` trades the two: one huge bucket is `flat` with no
overlap; a tiny one is `overlap`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .overlap import OverlapDDP
from .planning import ParamInfo, plan_buckets


class Bucket:
    """One flat buffer, a view of it per member parameter, in launch order."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


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

    def _plan_units(self) -> list[list[int]]:
        infos = [
            ParamInfo(nbytes=p.numel() * p.element_size(), group=(p.device, p.dtype))
            for p in self.sync_params
        ]
        plan = plan_buckets(infos, self.bucket_size_mb)
        self.buckets = [Bucket([self.sync_params[i] for i in unit]) for unit in plan]
        return plan

    def _launch(self, unit: int) -> tuple[dist.Work | None, object]:
        bucket = self.buckets[unit]
        for index, view in zip(self.units[unit], bucket.views):
            grad = self.sync_params[index].grad
            if self._locally_used[index] and grad is not None:
                # Divide on the way in: one pass over the gradient instead of a copy and then a
                # div_ of the buffer (the same rounding, bitwise; the copies are what a CPU
                # all-reduce competes with for memory bandwidth).
                torch.div(grad, self.world_size, out=view)
            else:
                view.zero_()  # not produced here: contributes zero, and no stale values ride along
        return self._all_reduce_async(bucket.buffer), bucket

    def _complete(self, unit: int, payload: object, used: list[bool]) -> None:
        for index, view in zip(self.units[unit], payload.views):
            if used[index]:
                self._set_grad(self.sync_params[index], view)
