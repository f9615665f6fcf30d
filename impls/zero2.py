"""ZeRO-2: ZeRO-1 plus sharded gradients: a rank keeps only the gradients it steps.

What is communicated, when, and at what cost:
- construction: parameters are partitioned whole among the ranks (`partition_parameters`, as
  ZeRO-1 does) by the wrapper, and the optimizer (`zero2_optimizer`, ZeRO-1's
  `ShardedOptimizer`) is built over the same ownership, so it steps exactly the parameters
  whose gradients this rank keeps;
- during `backward()`: buckets as in `bucketed` (planned once, launched in plan order as each
  fills). A bucket's buffer is laid out by owner (`planning.plan_segments`): segment r holds
  the gradients of the members rank r owns, zero-padded to the largest rank's share. Gradients
  are divided by the world size on the way in, the `.grad` of every member this rank does not
  own is freed, and one async reduce-scatter leaves segment r, summed over ranks, on rank r;
- in `finish_gradient_synchronization()`: launch what is left, all-reduce the usage map, wait,
  and copy each owned segment into its parameters' `.grad` (other `.grad` stay None);
- in `optimizer.step()`: ZeRO-1's: step the owned parameters, broadcast each owner's shard.

Collectives per step: B reduce-scatters + 1 usage all-reduce + N broadcasts (ZeRO-1's). On the
wire a reduce-scatter moves (N-1)/N of its buffer, half an all-reduce's bytes, when the
bucket's bytes are spread evenly over owners; with whole-parameter ownership a bucket that one
rank owns entirely is padded to N times its size (pick buckets several parameters wide).
Memory after synchronization: gradients of the owned parameters only, about 1/N (how close:
`impls.sharding`), on top of ZeRO-1's optimizer state about 1/N; while buckets are in flight
each holds its padded input buffer, freed when it completes.

Gradients are bitwise those of `zero1` where the collectives add in the same order (always on
2 ranks): same division on the way in, same sum; the optimizer arithmetic is ZeRO-1's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .bucketed import BucketedDDP
from .planning import plan_segments
from .sharding import partition_parameters
from .zero import ShardedOptimizer


class ShardedBucket:
    """One bucket laid out by owner (`plan_segments`); owns its input buffer, its output shard
    and the handle of the reduce-scatter between them."""

    def __init__(self, params: list[nn.Parameter], owners: list[int], world_size: int) -> None:
        self.params, self.owners, self.world_size = params, owners, world_size
        self.plan = plan_segments([p.numel() for p in params], owners, world_size)
        self.handle: dist.Work | None = None
        self.shard: torch.Tensor | None = None  # this rank's summed segment, once launched
        self._input: torch.Tensor | None = None  # kept alive until the collective completes

    def launch(self, grads: list[torch.Tensor | None], rank: int, group) -> None:
        """Reduce-scatter `grads` (None: contributes zeros), divided by the world size."""
        p0, segment = self.params[0], self.plan.segment
        buffer = torch.zeros(segment * self.world_size, dtype=p0.dtype, device=p0.device)
        for grad, param, offset in zip(grads, self.params, self.plan.offsets):
            if grad is not None:  # divide on the way in, as `bucketed` does: same rounding
                segment_of = buffer[offset : offset + param.numel()].view_as(grad)
                torch.div(grad, self.world_size, out=segment_of)
        if self.world_size == 1:
            self.shard = buffer
            return
        self.shard, self._input = buffer.new_empty(segment), buffer
        self.handle = dist.reduce_scatter_tensor(self.shard, buffer, group=group, async_op=True)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        self.handle = self._input = None

    def owned(self, rank: int):
        """(member index, its averaged gradient as a view of the shard) for members `rank` owns."""
        for i, (param, owner) in enumerate(zip(self.params, self.owners)):
            if owner == rank:
                start = self.plan.offsets[i] - rank * self.plan.segment
                yield i, self.shard[start : start + param.numel()].view_as(param)


class Zero2DDP(BucketedDDP):
    """Bucketed reduce-scatter of gradients to their owner rank (see module docstring).

    Args: as `BucketedDDP` (`bucket_size_mb=`, `process_group=`, `broadcast_buffers=`).
    Pair it with `zero2_optimizer(params, optimizer_cls, wrapped=this)`: any other optimizer
    would step parameters whose gradients this rank no longer holds.
    """

    def _plan_units(self) -> list[list[int]]:
        self.rank = dist.get_rank(self.process_group)
        sizes = [p.numel() * p.element_size() for p in self.sync_params]
        self.owners = list(partition_parameters(sizes, self.world_size).owners)
        self._owner = {id(p): r for p, r in zip(self.sync_params, self.owners)}
        plan = self._bucket_plan()  # `bucketed`'s plan, each bucket laid out by owner
        self.buckets = [
            ShardedBucket(
                [self.sync_params[i] for i in unit],
                [self.owners[i] for i in unit],
                self.world_size,
            )
            for unit in plan
        ]
        return plan

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank that keeps `param`'s gradient and optimizer state."""
        try:
            return self._owner[id(param)]
        except KeyError:
            raise ValueError(
                "zero2: the optimizer got a parameter the wrapper does not train (build the "
                "optimizer over the wrapped module's trainable parameters)"
            ) from None

    def _launch(self, unit: int) -> tuple[dist.Work | None, object]:
        bucket = self.buckets[unit]
        members = self.units[unit]
        grads = [self.sync_params[i].grad if self._locally_used[i] else None for i in members]
        bucket.launch(grads, self.rank, self.process_group)
        for index in members:  # the input buffer holds our part now: free what we do not own
            if self.owners[index] != self.rank:
                self.sync_params[index].grad = None
        return bucket.handle, bucket

    def _complete(self, unit: int, payload: object, used: list[bool]) -> None:
        payload.wait()  # done already (the base waits on every handle first): frees the input
        for member, grad in payload.owned(self.rank):
            index = self.units[unit][member]
            if used[index]:
                self._set_grad(self.sync_params[index], grad)
        payload.shard = None

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every trainable parameter's averaged gradient, by the wrapped module's parameter
        names, sent from its owner (None where the owner holds none). For checkers; a
        collective: call it on every rank after `finish_gradient_synchronization()`."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        device = self.sync_params[0].device if self.sync_params else torch.device("cpu")
        present = torch.tensor(
            [o == self.rank and p.grad is not None for p, o in zip(self.sync_params, self.owners)],
            dtype=torch.int32,
            device=device,
        )
        if self.world_size > 1:
            dist.all_reduce(present, group=self.process_group)
        full: dict[str, torch.Tensor | None] = {}
        for param, owner, has in zip(self.sync_params, self.owners, present.tolist()):
            grad = None
            if has:
                grad = param.grad.clone() if owner == self.rank else torch.empty_like(param)
                if self.world_size > 1:
                    src = dist.get_global_rank(self.process_group, owner)
                    dist.broadcast(grad, src=src, group=self.process_group)
            full[names[id(param)]] = grad
        return full


def zero2_optimizer(params, optimizer_cls, *, process_group=None, wrapped=None, **defaults):
    """ZeRO-1's `ShardedOptimizer` over the ownership `wrapped` (a `Zero2DDP`) decided."""
    if not isinstance(wrapped, Zero2DDP):
        raise ValueError("zero2's optimizer needs its Zero2DDP wrapper: pass wrapped=")
    return ShardedOptimizer(
        params, optimizer_cls, process_group=process_group, owner_of=wrapped.owner_of, **defaults
    )
