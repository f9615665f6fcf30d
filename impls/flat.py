"""Flat data parallelism: after backward, one all-reduce of all gradients flattened together.

What is communicated, when, and at what cost:
- after `backward()` returns, in `finish_gradient_synchronization()`: the gradients of every
  parameter used on some rank are concatenated into one buffer per (device, dtype), divided by
  the world size, all-reduced once, and copied back;
- plus one all-reduce of the usage map (see `base.py`);
- collectives per step: 1 per dtype + 1; extra memory: one flat copy of the gradients.

The idea it adds to `naive`: pay the per-collective latency once instead of once per tensor.
Nothing overlaps the backward pass yet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import DataParallel, group_by_device_dtype


class FlatDDP(DataParallel):
    """One all-reduce of the flattened gradients per dtype after backward."""

    def _finish_synchronization(self) -> None:
        used = self._globally_used()
        # Parameters unused on every rank are left out: their .grad stays untouched.
        indices = [i for i, u in enumerate(used) if u]
        for group in group_by_device_dtype(indices, lambda i: self.sync_params[i]):
            grads = [self._local_grad(i) for i in group]
            flat = torch._utils._flatten_dense_tensors(grads)
            # Divide before summing, as DDP's default hook does: keeps low-precision sums in range.
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.process_group)
            for i, averaged in zip(group, torch._utils._unflatten_dense_tensors(flat, grads)):
                self._set_grad(self.sync_params[i], averaged)
