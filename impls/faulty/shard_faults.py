"""Broken ZeRO-3 wrappers: what the reduce-scatter divides and pads, when and into what a unit
is gathered, and a class that says it shards parameters and does not.

Each class changes one method of `impls.zero3.Zero3DDP`; the line that is wrong carries a
`# BUG:` comment. Registered as DDP wrappers with `full_parameters()`, they are built as a
user's parameter-sharding class would be: a plain optimizer over the shards, and the checks
read whole tensors through the wrapper (`verify/training/sharded.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from impls.naive import NaiveDDP
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

    def _reduce_scatter(self, unit) -> None:
        unit.start_reduce_scatter(self.process_group, divide_by=1)  # BUG: the sum


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


@fault("zero3-accumulation-lost", caught_by="equivalence", shows_on=("no-sync",))
class FreshLeavesEveryForward(Zero3DDP):
    """Makes new full-parameter tensors at every forward: a `no_sync()` micro-step's
    gradients, left on the old ones, never reach the reduce-scatter.

    Symptom: with gradient accumulation the step uses the gradient of one micro-batch out of
    K (and K times smaller, as it is divided by K for the average); without accumulation
    every forward is followed by its own backward and nothing shows.

    Caught by equivalence on the accumulation row, at the first gradient check.
    """

    def _unshard(self, unit) -> None:
        unit.gather(self.process_group)
        # BUG: fresh leaves: the gradients accumulated on the old ones are dropped
        unit.leaves = [unit._leaf(i) for i in range(len(unit.shapes))]
        unit.install(unit.leaves)


@fault("zero3-stale-on-one-rank", caught_by="equivalence", shows_on=("world-2",))
class StaleParametersOnLastRank(Zero3DDP):
    """On the last rank, the forward keeps the parameters it gathered first: the updated
    shards never reach that rank's computation again.

    Symptom: from the second step on, the last rank computes its loss and gradients with the
    initial parameters; the reduce-scatter mixes them into every rank's gradient shard, so the
    ranks agree with each other (consistency passes) and all train on a wrong gradient.

    Caught by equivalence at the second step's gradient check.
    """

    def _unshard(self, unit) -> None:
        unit.gather(self.process_group)
        if self.rank == self.world_size - 1:
            first = self.__dict__.setdefault("_first", {})
            # BUG: the first gather's values replace every later one on this rank
            unit.full.copy_(first.setdefault(id(unit), unit.full.clone()))
        unit.install(unit.leaves)


@fault("zero3-padded-tail-dropped", caught_by="equivalence", shows_on=("odd-sizes",))
class PaddedTailDropped(Zero3DDP):
    """Copies the gradient into the reduce-scatter input whole chunks only: the last rows of
    a parameter whose rows N does not divide are sent as zeros, as padding.

    The input is built one rank chunk (ceil(rows / N) rows) at a time, and a chunk the
    gradient does not fill is skipped; that partial chunk holds real rows before its padding.

    Symptom: the rows in the rank shard that holds the padding get a zero gradient (AdamW
    only decays them), alike on every rank, so consistency passes. Where the world size
    divides every parameter's rows (the MLP at 2 or 4 ranks) no chunk is partial and every
    value is right; at 3 ranks the MLP's 32-row layers show it too.

    Caught by equivalence on the odd-sizes row (7, 3, 5 and 1 rows over 4 ranks: the 7-row
    layer's last row lives in a padded chunk), at the first gradient check.
    """

    def _reduce_scatter(self, unit) -> None:
        n = self.world_size
        grads = torch.zeros(unit.total * n, dtype=unit.full.dtype, device=unit.full.device)
        ranks = grads.view(n, unit.total)  # [rank][this rank's chunk of every parameter]
        start, unit.used = 0, []
        for leaf, chunk in zip(unit.leaves, unit.chunk):
            unit.used.append(leaf.grad is not None)
            if leaf.grad is not None:
                flat = leaf.grad.reshape(-1) / n
                for r in range(n):
                    if (r + 1) * chunk <= flat.numel():  # BUG: a partial chunk is not padded
                        ranks[r, start : start + chunk].copy_(flat[r * chunk : (r + 1) * chunk])
            leaf.grad = None
            start += chunk
        if n == 1:
            unit.reduced = grads
            return
        unit.reduced = grads.new_empty(unit.total)
        handle = dist.reduce_scatter_tensor(
            unit.reduced, grads, group=self.process_group, async_op=True
        )
        unit.reducing = (handle, grads)


@fault("zero3-unsharded", caught_by="shard", shows_on=("world-2",))
class KeepsFullParameters(NaiveDDP):
    """Offers `full_parameters()` (parameters sharded) but never shards them: the optimizer
    is built over the full parameters.

    Symptom: training is exactly data-parallel SGD/AdamW (every value right), and every rank
    holds the whole model, its gradients and its optimizer state: no memory saved.

    Caught by the shard check (the memory check of a parameter-sharding class): parameters,
    gradients and state each about 1/1, not 1/N, per rank.
    """

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        # BUG: the module's own parameters, whole on every rank: nothing was ever sharded
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}


@fault("zero3-load-wrong-rows", caught_by="equivalence", shows_on=("model-round-trip",))
class LoadsWrongRows(Zero3DDP):
    """`load_state_dict()` of a full checkpoint (`state_dict()` gathers) cuts every rank's
    shard from the first rows: every rank resumes from rank 0's rows.

    Symptom: training is right until the first checkpoint is loaded; from then on every rank
    but rank 0 trains the wrong rows (rank 0's copy), and the ranks still agree on every full
    tensor they put together, so consistency passes.

    Caught by equivalence on the model-round-trip row, at the first step after the load.
    """

    @torch.no_grad()
    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters as the module holds them, every sharded one whole."""
        return {**self.module.state_dict(), **self.full_parameters()}

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        local = dict(state_dict)
        for unit, names in zip(self.units, self.unit_names):
            for name, shard in zip(names, unit.shards):
                rows = shard.shape[0]
                piece = state_dict[name][:rows]  # BUG: rank 0's rows, not [rank * rows :][:rows]
                padded = torch.zeros_like(shard)
                padded[: piece.shape[0]] = piece
                local[name] = padded
        return self.module.load_state_dict(local, strict=strict)
