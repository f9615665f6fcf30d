"""Naive data parallelism: after backward, one all-reduce per parameter gradient.

What is communicated, when, and at what cost:
- after `backward()` returns, in `finish_gradient_synchronization()`: one blocking all-reduce
  (SUM) per trainable parameter tensor, then a division by the world size;
- plus one all-reduce of the usage map (a few bytes per parameter; see `base.py`);
- collectives per step: P + 1 for P trainable parameter tensors; no extra memory.

It is the baseline of the ladder: nothing overlaps the backward pass, and small parameters
(biases, norms) each pay the full per-collective latency.
"""

from __future__ import annotations

import torch.distributed as dist

from .base import DataParallel


class NaiveDDP(DataParallel):
    """One blocking all-reduce per gradient after backward (see module docstring)."""

    def _finish_synchronization(self) -> None:
        # The usage map goes first: no gradient collective has been launched yet, so every
        # rank is at the same point of the collective sequence.
        used = self._globally_used()
        for index, param in enumerate(self.sync_params):
            if not used[index]:
                continue  # unused on every rank: leave .grad untouched, as PyTorch DDP does
            grad = self._local_grad(index)
            dist.all_reduce(grad, group=self.process_group)
            grad.div_(self.world_size)
            self._set_grad(param, grad)
