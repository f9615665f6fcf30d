"""Broken bucketed DDP: when a bucket counts as ready, and which buckets are sent at all.

Each class changes one method of `impls.bucketed.BucketedDDP` (or of `OverlapDDP`, whose
launch machinery it inherits). The line that is wrong carries a `# BUG:` comment. Most of
these need several buckets to show: the matrix's "several-buckets" behaviour plans four
multi-parameter buckets on the workload with unused parameters.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from impls.bucketed import BucketedDDP

from .catalogue import fault


@fault("ready-when-not-none", caught_by="equivalence", shows_on=("no-sync",))
class ReadyWhenNotNone(BucketedDDP):
    """Declares a bucket ready when every member's `.grad` is not None, instead of counting
    the gradients that arrived in this backward.

    Symptom: right with `zero_grad()` (set_to_none) and one backward per step. With
    `zero_grad(set_to_none=False)`, or on the synchronized backward after `no_sync()`
    micro-steps, every `.grad` already exists, so every bucket is "ready" at the first hook
    and goes out before backward has computed its gradients: the average is of zeros (or of
    the earlier micro-steps only), the same on every rank. (With `set_to_none=False`, where
    `.grad` is the bucket's view from the second step on, the late gradients are also added
    into the buffer while it is on the wire: a race.)

    Caught by equivalence on the `no_sync()` behaviour (and on `set_to_none=False` when no
    bucket holds a parameter that never gets a gradient: such a bucket is never "ready", so
    it goes out correctly at the end, as a bucket should).
    """

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        for unit in range(self._next_unit, len(self.units)):
            # BUG: "has a .grad" is not "its gradient for this backward has arrived".
            members = [self.sync_params[i] for i in self.units[unit]]
            self._missing[unit] = sum(p.grad is None for p in members)
        self._launch_ready_units()


@fault("launch-on-last-member", caught_by="equivalence", shows_on=("several-buckets",))
class LaunchesOnLastMember(BucketedDDP):
    """Launches a bucket from the hook of the member expected to be ready last (the bucket's
    first-registered parameter) instead of counting its ready gradients.

    Symptom: right while backward produces gradients in reverse registration order. A model
    whose forward uses a layer registered after the ones it feeds (a branch registered last
    but used mid-network) breaks that order: the bucket goes out before some members'
    gradients arrive, those travel as zeros, and their late gradients are dropped, on every
    rank alike.

    Caught by equivalence on "several-buckets": there the `sometimes` branch shares a bucket
    with `fc2`, whose gradient arrives first.
    """

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        unit = self._unit_of[index]
        if index == self.units[unit][-1]:  # BUG: assumes this member's gradient comes last
            self._missing[unit] = 0
            self._launch_ready_units()


@fault("final-bucket-unsent", caught_by="consistency", shows_on=("one-bucket", "several-buckets"))
class NeverSendsFinalBucket(BucketedDDP):
    """Sends a bucket only once it is full, and never flushes the final, partly filled one.

    Symptom: the gradients in the last bucket (the first layers of the model, or the whole
    model when it fits in one bucket) are never averaged: each rank steps them with its own
    gradient divided by N, and the replicas drift apart.

    Caught by consistency at the first gradient audit, whenever the last bucket is not full
    (one big bucket, or several where the last is partial).
    """

    def _all_reduce_async(self, tensor: torch.Tensor) -> dist.Work | None:
        final = self.buckets[-1].buffer
        cap = (self.bucket_size_mb or math.inf) * 1024 * 1024  # None: no cap
        if tensor is final and final.numel() * final.element_size() < cap:
            return None  # BUG: a bucket that is not full is never sent
        return super()._all_reduce_async(tensor)


@fault("skip-bucket-missing-grad", caught_by="equivalence", shows_on=("unused-everywhere",))
class SkipsBucketWithMissingGrad(BucketedDDP):
    """Skips the all-reduce of a bucket in which some parameter got no gradient on this rank,
    instead of sending zeros for it.

    Symptom: when a parameter is unused on every rank, every rank skips its bucket: the
    bucket's other gradients become whatever the bucket buffer held (zeros at first, then the
    last step's averages, or this rank's own undivided gradients where `.grad` already was
    the bucket's view). When it is unused on some ranks only, those ranks issue
    one all-reduce fewer than the others: the k-th collectives no longer match, and gloo
    aborts on a size mismatch or the run hangs (the "several-buckets" behaviour shows it).

    Caught by equivalence on the workload with a parameter no rank uses (its bucket is the
    whole model at the default bucket size); consistency reports the crash where ranks differ.
    """

    def _launch(self, unit: int) -> tuple[dist.Work | None, object]:
        if not all(self._locally_used[i] for i in self.units[unit]):
            return None, self.buckets[unit]  # BUG: nothing sent; the peers still send theirs
        return super()._launch(unit)


__all__ = [
    "LaunchesOnLastMember",
    "NeverSendsFinalBucket",
    "ReadyWhenNotNone",
    "SkipsBucketWithMissingGrad",
]
