"""Broken ZeRO-3 wrappers: what the reduce-scatter divides and when a unit is gathered.

Each class changes one method of `impls.zero3.Zero3DDP`; the line that is wrong carries a
`# BUG:` comment. Registered as DDP wrappers with `full_parameters()`, they are built as a
user's parameter-sharding class would be: a plain optimizer over the shards, and the checks
read whole tensors through the wrapper (`verify/training/sharded.py`).
"""

from __future__ import annotations

from impls.zero3 import Zero3DDP, _Saved

from .catalogue import fault


@fault("zero3-no-divide", caught_by="equivalence", shows_on=("world-2",))
class ReduceScatterWithoutDividing(Zero3DDP):
    """Reduce-scatters the gradients without dividing by the world size: each rank's rows
    hold the sum over ranks, not the average.

    Symptom: every gradient is N times too large; the ranks agree with each other, so
    consistency passes, and the parameters move N times too far (SGD) or barely differently
    (AdamW normalizes the scale away, which is why the gradients are the place to look).

    Caught by equivalence at the first gradient check.
    """

    def _finish_synchronization(self) -> None:
        for unit in self.units:
            grads = unit.reduce_scatter(self.process_group, divide_by=1)  # BUG: the sum
            for shard, grad in zip(unit.shards, grads):
                if grad is not None:
                    self._set_grad(shard, grad)
            unit.free()


@fault("zero3-not-regathered", caught_by="consistency", shows_on=("world-2",))
class NotRegatheredForBackward(Zero3DDP):
    """Frees each unit after its forward but does not gather it again for its backward: the
    tensors autograd saved are read from the freed buffer.

    Symptom: the first backward reads parameters whose memory is gone. Here the buffer's
    storage has size 0 and the read raises on every rank; on a GPU allocator that reuses
    the memory it reads whatever was put there since (stale or foreign values), silently.

    Caught by consistency (the first check a cell runs): every rank raises in the backward.
    """

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        # BUG: no saved.unit.gather(...): the unit was freed after its forward
        return saved.unit.full.as_strided(saved.size, saved.stride, saved.offset)
