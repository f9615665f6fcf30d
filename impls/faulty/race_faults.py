"""Races on async collectives: each is right on most runs on a CPU, and wrong now and then.

Each class changes one method of a correct built-in; the line that is wrong carries a
`# BUG:` comment. Without help these pass most checks on most runs (gloo usually finishes an
all-reduce before the racing line touches its tensor), so they are caught under the race
sanitizer (`--sanitize`): its access report names the operator, the tensor and both lines, and
its adversarial completion (a collective reads its input at issue and writes its result only
at `wait()`) makes the wrong numbers come out the same way on every run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from impls.bucketed import BucketedDDP
from impls.overlap import OverlapDDP
from impls.zero import ShardedOptimizer
from impls.zero2 import Zero2DDP

from .catalogue import fault


@fault("step-before-wait", caught_by="equivalence", shows_on=("world-2",), sanitize=True)
class StepsBeforeWait(OverlapDDP):
    """`finish_gradient_synchronization()` returns without waiting for the all-reduces; they
    are waited on at the start of the next step instead.

    Symptom: `optimizer.step()` reads gradients that are still being reduced: on a GPU it
    steps with a partly reduced gradient now and then, on a CPU almost never.

    Caught by equivalence under --sanitize (the sanitizer reports the optimizer's reads of the
    gradients in flight, and its adversarial completion makes the step use the local
    gradients on every run).
    """

    def on_train_batch_start(self) -> None:
        for _, handle, _ in getattr(self, "_late", []):
            if handle is not None:
                handle.wait()
        self._late = []

    def _finish_synchronization(self) -> None:
        self._launch_ready_units(force=True)
        used = self._globally_used()
        for unit, _, payload in self._in_flight:
            self._complete(unit, payload, used)
        self._late = self._in_flight  # BUG: waited on at the next step, after optimizer.step()
        self._reset()


@fault("divide-before-wait", caught_by="equivalence", shows_on=("world-2",), sanitize=True)
class DividesBeforeWait(OverlapDDP):
    """Each gradient is divided by the world size right after its async all-reduce is
    launched, while the all-reduce still reads and writes it.

    Symptom: depending on when the backend touches the tensor, the average comes out right,
    or as the sum, or as a mix of both; on a CPU it is almost always right.

    Caught by equivalence under --sanitize (`div_` wrote the gradient while the all-reduce
    on it was in flight; with adversarial completion the result is the undivided sum).
    """

    def _launch(self, unit: int):
        (index,) = self.units[unit]
        grad = self._local_grad(index)
        handle = self._all_reduce_async(grad)
        grad.div_(self.world_size)  # BUG: divides the tensor the all-reduce is working on
        return handle, grad


@fault(
    "shared-staging-buffer", caught_by="equivalence", shows_on=("several-buckets",), sanitize=True
)
class ReusesStagingBuffer(BucketedDDP):
    """Every bucket is copied into one shared staging buffer and all-reduced from it, so a
    later bucket's copy overwrites the buffer while an earlier bucket is still being sent.

    Symptom: a bucket's average holds some of the next bucket's gradients whenever the copy
    wins the race with the transfer; on a CPU it rarely does.

    Caught by equivalence under --sanitize (the sanitizer reports `copy_` writing the staging
    buffer while an all-reduce of it is in flight).
    """

    def _launch(self, unit: int):
        bucket = self.buckets[unit]
        staging = self._staging_for(bucket)
        for index, view in zip(self.units[unit], bucket.views, strict=True):
            grad = self.sync_params[index].grad
            local = grad if self._locally_used[index] and grad is not None else None
            view.copy_(local / self.world_size if local is not None else torch.zeros_like(view))
        staging.copy_(bucket.buffer)  # BUG: the shared buffer may still be in flight
        return self._all_reduce_async(staging), (bucket, staging)

    def _staging_for(self, bucket) -> torch.Tensor:
        """The front of the one shared buffer (as large as the largest bucket), made on first
        use with the bucket's dtype and device: on NCCL a CPU buffer could not be all-reduced."""
        if not hasattr(self, "_staging"):
            size = max(b.buffer.numel() for b in self.buckets)
            self._staging = bucket.buffer.new_zeros(size)
        return self._staging[: bucket.buffer.numel()]

    def _complete(self, unit: int, payload, used: list[bool]) -> None:
        bucket, staging = payload
        bucket.buffer.copy_(staging)
        super()._complete(unit, bucket, used)

    def _finish_synchronization(self) -> None:
        # Waited and copied back one bucket at a time (the staging buffer holds one result).
        self._launch_ready_units(force=True)
        used = self._globally_used()
        for unit, handle, payload in self._in_flight:
            if handle is not None:
                handle.wait()
            self._complete(unit, payload, used)
        self._reset()


@fault("zero-unwaited-broadcast", caught_by="consistency", shows_on=("world-2",), sanitize=True)
class NeverWaitsBroadcast(ShardedOptimizer):
    """`step()` issues the async broadcasts of the updated shards and never waits on them.

    Symptom: the next forward reads parameters that may not have arrived yet; on a CPU the
    broadcasts usually land in time, on a GPU the replicas drift apart now and then.

    Caught by consistency under --sanitize (works never waited on at the end of the step;
    with adversarial completion the broadcasts never land and the replicas differ).
    """

    def _sync_params(self) -> None:
        if self.world_size == 1:
            return
        for owner, flat in self._flat:
            src = self._global_rank(owner)
            dist.broadcast(flat, src=src, group=self.process_group, async_op=True)  # BUG: no wait


@fault(
    "zero2-shared-scatter-input",
    caught_by="equivalence",
    shows_on=("several-buckets",),
    sanitize=True,
)
class SharesReduceScatterInput(Zero2DDP):
    """Every bucket builds its reduce-scatter input in one shared buffer, so a later bucket
    overwrites the buffer while an earlier bucket's reduce-scatter may still be reading it.

    Symptom: a gradient shard holds some of the next bucket's gradients whenever the overwrite
    wins the race with the transfer; on a CPU it rarely does.

    Caught by equivalence under --sanitize (the sanitizer reports the write into the buffer an
    in-flight reduce_scatter_tensor reads).
    """

    def _launch(self, unit: int):
        bucket, members = self.buckets[unit], self.units[unit]
        size = bucket.plan.segment * self.world_size
        if not hasattr(self, "_shared"):  # as large as the largest bucket's input
            first = self.sync_params[0]
            largest = max(b.plan.segment * self.world_size for b in self.buckets)
            self._shared = torch.empty(largest, dtype=first.dtype, device=first.device)
        buffer = self._shared[:size]
        buffer.zero_()  # BUG: the previous bucket's reduce-scatter may still read it
        for index, param, offset in zip(members, bucket.params, bucket.plan.offsets):
            grad = param.grad if self._locally_used[index] else None
            if grad is not None:
                torch.div(
                    grad, self.world_size, out=buffer[offset : offset + param.numel()].view_as(grad)
                )
        bucket.shard, bucket._input = buffer.new_empty(bucket.plan.segment), buffer
        bucket.handle = dist.reduce_scatter_tensor(
            bucket.shard, buffer, group=self.process_group, async_op=True
        )
        for index in members:
            if self.owners[index] != self.rank:
                self.sync_params[index].grad = None
        return bucket.handle, bucket
