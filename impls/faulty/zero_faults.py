"""Broken ZeRO-1 sharded optimizers: what the owner steps, syncs, zeroes, saves and adds.

Each class changes one method of `impls.zero.ShardedOptimizer`; the line that is wrong
carries a `# BUG:` comment. Registered as sharded optimizers, they run over PyTorch DDP (the
trusted reference wrapper), so whatever goes wrong is the optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from impls.zero import _NOT_HYPER, ShardedOptimizer

from .catalogue import fault


@fault("zero-no-param-sync", caught_by="consistency", shows_on=("world-2",))
class NeverSyncsParameters(ShardedOptimizer):
    """Steps the owned shard and never broadcasts the updated parameters to the other ranks.

    Symptom: each rank updates only the parameters it owns; every other parameter stays at its
    initial value there. After one step the replicas hold different models.

    Caught by consistency at the first audit after `optimizer.step()`.
    """

    def _sync_params(self) -> None:
        pass  # BUG: the owners' updates never reach the other ranks


@fault("zero-group-options-lost", caught_by="equivalence", shows_on=("world-2",))
class LosesGroupOptions(ShardedOptimizer):
    """Fills every parameter group from the optimizer's defaults with `dict.update`, so the
    groups' own options (learning rate, weight decay) are overwritten by the defaults.

    Symptom: every group trains with the default learning rate and weight decay: a
    no-decay group for biases and norms gets decayed, a group at a lower learning rate runs at
    the full one. The ranks agree (consistency passes).

    Caught by equivalence at the first parameter check (the workloads use two groups with
    different learning rates and weight decay).
    """

    def _adopt_inner_defaults(self) -> None:
        self.defaults = dict(self.inner.defaults)
        for group in self.param_groups:
            # BUG: update, not setdefault: the defaults win over the group's own options.
            group.update((k, v) for k, v in self.inner.defaults.items() if k not in _NOT_HYPER)


@fault("zero-grad-owned-only", caught_by="equivalence", shows_on=("world-2",))
class ZeroGradOwnedOnly(ShardedOptimizer):
    """`zero_grad()` clears only the gradients of the parameters this rank owns.

    Symptom: the gradients of the other parameters are never cleared on this rank, so the next
    backward adds to last step's averaged gradient; the all-reduce averages that stale sum in.
    From step 2 every gradient is wrong by (N-1)/N of the previous step's, the same on every
    rank.

    Caught by equivalence at the step 2 gradient check.
    """

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)  # BUG: the inner optimizer's params only


@fault("zero-no-shard", caught_by="shard", shows_on=("world-2",))
class DoesNotShard(ShardedOptimizer):
    """Gives the inner optimizer every parameter on every rank: nothing is sharded.

    Symptom: none in the numbers (every rank computes every update, and the owners'
    broadcasts change nothing); each rank holds the whole model's optimizer state, N times
    the memory ZeRO-1 exists to save.

    Caught only by the shard check: each rank's optimizer-state bytes against 1/N of the
    unsharded optimizer's (within the whole-parameter partition's bound).
    """

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        local = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        local["params"] = list(group["params"])  # BUG: all of them, not the owned ones
        if "param_names" in group:
            local["param_names"] = list(group["param_names"])
        return local


@fault("zero-local-state-dict", caught_by="equivalence", shows_on=("round-trip",))
class SavesOnlyItsShard(ShardedOptimizer):
    """`state_dict()` returns only this rank's shard of the state instead of gathering the
    full state.

    Symptom: a checkpoint written by rank 0 (the usual way) holds rank 0's shard only. After
    loading it, the other ranks' parameters restart AdamW from empty moments: the run silently
    diverges from the one it resumed.

    Caught by equivalence on the state_dict round trip (rank 0's state dict is loaded on every
    rank, as a checkpoint would be).
    """

    def state_dict(self) -> dict[str, Any]:
        local = {self._index[id(p)]: s for p, s in self.inner.state.items()}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [self._index[id(p)] for p in g["params"]]
            groups.append(packed)
        return {"state": local, "param_groups": groups}  # BUG: never gathered from the others


@fault("zero-add-group-unsharded", caught_by="equivalence", shows_on=("add-param-group",))
class AddedGroupNeverStepped(ShardedOptimizer):
    """`add_param_group()` after construction records the group but neither re-partitions
    nor hands it to the inner optimizer.

    Symptom: the new group's parameters appear in `param_groups` (so `zero_grad` and LR
    schedulers see them), but no rank owns them: they are never updated, on every rank alike.

    Caught by equivalence on the behaviour that adds the second parameter group after
    construction.
    """

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)  # BUG: the inner never sees it


@fault("zero-ignores-scheduler", caught_by="equivalence", shows_on=("scheduler",))
class IgnoresScheduler(ShardedOptimizer):
    """`step()` never copies the global groups' hyper-parameters to the inner optimizer's.

    Symptom: an LR scheduler (or any `group["lr"] = ...`) changes the groups the user sees,
    but the inner optimizer keeps stepping with the learning rates of construction time.

    Caught by equivalence on the behaviour with an LR scheduler (StepLR halving every step).
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner.step()  # BUG: the groups' current lr (and other options) are not copied
        self._sync_params()
        return loss


__all__ = [
    "AddedGroupNeverStepped",
    "DoesNotShard",
    "IgnoresScheduler",
    "LosesGroupOptions",
    "NeverSyncsParameters",
    "SavesOnlyItsShard",
    "ZeroGradOwnedOnly",
]
