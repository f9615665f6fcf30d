"""ZeRO-1: each rank keeps and steps the optimizer state of its own shard of the parameters.

Cost per step: one broadcast per (owner rank, device, dtype) of that owner's flat parameter
buffer, i.e. N broadcasts per dtype moving every trainable byte once (about the bytes of the
all-gather in ZeRO papers). Memory: optimizer state drops from the whole model to about 1/N
of it on each rank (see `impls.sharding` for how close to 1/N); parameters and gradients
stay replicated. Gradients must already be averaged across ranks (by a DDP wrapper) when
`step()` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from impls.sharding import ShardPlan, assigned_plan, partition_parameters

# Group keys that are not hyper-parameters: they list this group's tensors, so the local
# groups hold the owned subset of them instead of a copy.
_NOT_HYPER = ("params", "param_names")


class _Packed(NamedTuple):
    """A state tensor on its way to another rank: CPU bytes, and whether it lived on the
    parameter's device (so the receiver puts it on *its* parameter's device, not ours)."""

    tensor: torch.Tensor
    on_param_device: bool


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 sharding of any `torch.optim.Optimizer` class.

    Construction (no communication: every rank derives the same plan on its own):
      1. `self.param_groups` are the GLOBAL groups with every parameter, so `zero_grad`, LR
         schedulers and manual `group["lr"] = ...` work as on any optimizer.
      2. `partition_parameters` assigns each parameter that requires grad, whole, to one
         rank (same plan on every rank, no communication). Frozen parameters get no owner.
         With `owner_of`, the caller decides instead (ZeRO-2's wrapper, `impls.zero2`).
      3. `self.inner = optimizer_cls(local_groups, **defaults)`: one local group per global
         group, same hyper-parameters, only the owned parameters (possibly none).
      4. For each owner rank and (device, dtype), one flat buffer; every owned parameter's
         `.data` becomes a view into it, so the inner step writes straight into the buffer.

    Phases of `step()`, in order:
      1. closure (if any) under `torch.enable_grad()`.
      2. copy hyper-parameters global -> local groups (schedulers write the global ones).
      3. `zero1.step`: the inner optimizer steps the owned shard only (no communication).
      4. `zero1.sync_params`: for each (device, dtype), for each owner rank, broadcast its
         flat buffer from it; receivers get the values straight into their parameters.

    Contracts:
      - `step`, `state_dict` and `add_param_group` are collectives: call them on all ranks
        in the same order or training hangs. `load_state_dict` does not communicate but
        must get the same full state dict on every rank.
      - Every rank passes the same parameters in the same order, with the same shapes,
        dtypes and `requires_grad` (the plan is computed independently on each rank).
        `requires_grad` is read at construction and at `add_param_group` only.
      - Parameters' storage is replaced by views into flat buffers: do not move them
        (`module.to(...)`) or reassign `.data` after construction; in-place writes are fine.
      - The inner optimizer must treat `param_groups` and `state` as its only record of
        parameters (all of `torch.optim` except LBFGS does).
      - `state_dict()` is the full, unsharded state in `optimizer_cls`'s own format on every
        rank, so checkpoints move freely between sharded and plain optimizers.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        owner_of: Callable[[torch.Tensor], int] | None = None,
        **defaults: Any,
    ) -> None:
        self._owner_of = owner_of  # None: partition_parameters decides
        # torch.optim.Optimizer.__init__ calls self.add_param_group once per group; until
        # `_ready` is set our override only records the group (there is no inner yet).
        self._ready = False
        self.optimizer_cls = optimizer_cls
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        elif process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialized")
        else:
            self.rank, self.world_size = 0, 1  # single process: sharding degenerates
        super().__init__(params, defaults)
        self._plan_shards()
        self.inner = optimizer_cls([self._local_group(g) for g in self.param_groups], **defaults)
        self._adopt_inner_defaults()
        self.state = self.inner.state  # so `optimizer.state[p]` works for owned params
        self._build_buffers()
        self._ready = True

    # ----- introspection for checkers and benchmarks -----

    def owned_parameters(self) -> list[torch.Tensor]:
        """Parameters whose optimizer state lives on this rank."""
        return [p for p in self._trainable if self._owner[id(p)] == self.rank]

    def local_state_bytes(self) -> int:
        """Bytes of the tensors in the inner optimizer's state on this rank."""
        return sum(
            v.numel() * v.element_size()
            for s in self.inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    # ----- the step -----

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the owned shard, then broadcast every shard. Collective: call on all ranks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with record_function("zero1.step"):
            for global_group, local_group in zip(self.param_groups, self.inner.param_groups):
                local_group.update((k, v) for k, v in global_group.items() if k not in _NOT_HYPER)
            self.inner.step()
        with record_function("zero1.sync_params"):
            self._sync_params()
        return loss

    def _sync_params(self) -> None:
        if self.world_size == 1:
            return
        # Issue all broadcasts before waiting: every rank issues them in the same order.
        works = [
            dist.broadcast(
                flat, src=self._global_rank(owner), group=self.process_group, async_op=True
            )
            for owner, flat in self._flat
        ]
        for work in works:
            work.wait()

    # ----- partitioning, local groups and flat buffers -----

    def _plan_shards(self) -> None:
        """(Re)compute the global index of every parameter and the owner of trainable ones."""
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._trainable = [p for p in self._params if p.requires_grad]
        sizes = [p.numel() * p.element_size() for p in self._trainable]
        if self._owner_of is None:
            self.plan: ShardPlan = partition_parameters(sizes, self.world_size)
        else:
            owners = [self._owner_of(p) for p in self._trainable]
            self.plan = assigned_plan(sizes, owners, self.world_size)
        self._owner = {id(p): r for p, r in zip(self._trainable, self.plan.owners)}

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """The inner optimizer's view of a global group: same hyper-parameters, owned params."""
        local = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        mine = [i for i, p in enumerate(group["params"]) if self._owner.get(id(p)) == self.rank]
        local["params"] = [group["params"][i] for i in mine]
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in mine]
        return local

    def _adopt_inner_defaults(self) -> None:
        # Our groups were filled from the caller's kwargs only; the inner optimizer filled
        # its groups with every default (betas, eps, ...). Copy those back so the global
        # groups, and state_dict(), look exactly like a plain optimizer_cls's.
        self.defaults = dict(self.inner.defaults)
        for global_group, local_group in zip(self.param_groups, self.inner.param_groups):
            for k, v in local_group.items():
                if k not in _NOT_HYPER:
                    global_group.setdefault(k, v)

    def _build_buffers(self) -> None:
        """One flat buffer per (owner, device, dtype); owned params become views into it."""
        by_key: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
        for p in self._trainable:
            ranks = by_key.setdefault((p.device, p.dtype), [[] for _ in range(self.world_size)])
            ranks[self._owner[id(p)]].append(p)
        self._flat: list[tuple[int, torch.Tensor]] = []
        # Sort by device type, not device: under NCCL each rank's device index differs.
        for device, dtype in sorted(by_key, key=lambda k: (k[0].type, str(k[1]))):
            for owner, params in enumerate(by_key[(device, dtype)]):
                numel = sum(p.numel() for p in params)
                if numel == 0:
                    continue  # all ranks skip it alike: nothing to broadcast
                flat = torch.empty(numel, device=device, dtype=dtype)
                offset = 0
                for p in params:
                    view = flat[offset : offset + p.numel()]
                    view.copy_(p.detach().reshape(-1))  # keep the current values
                    p.data = view.view_as(p)
                    offset += p.numel()
                self._flat.append((owner, flat))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group and re-partition everything. Collective after construction: call it
        on all ranks with the same group; state of parameters that change owner is moved."""
        super().add_param_group(param_group)
        if not self._ready:
            return  # called from Optimizer.__init__; __init__ builds the rest afterwards
        self._plan_shards()
        # Pull out the state of params this rank owned but no longer owns, and share it.
        leaving = [p for p in self.inner.state if self._owner.get(id(p)) != self.rank]
        outgoing = {self._index[id(p)]: self.inner.state.pop(p) for p in leaving}
        arriving = self._exchange_state(outgoing)
        for group, local in zip(self.param_groups, self.inner.param_groups):
            fresh = self._local_group(group)
            local["params"] = fresh["params"]
            if "param_names" in fresh:
                local["param_names"] = fresh["param_names"]
        self.inner.add_param_group(self._local_group(self.param_groups[-1]))
        self._adopt_inner_defaults()
        for i, s in arriving.items():
            p = self._params[i]
            if self._owner.get(id(p)) == self.rank:  # our own leavers come back too: skip
                self.inner.state[p] = s
        self._build_buffers()

    # ----- checkpoints -----

    def state_dict(self) -> dict[str, Any]:
        """Full unsharded state, in `optimizer_cls`'s format, on every rank. Collective."""
        local = {self._index[id(p)]: s for p, s in self.inner.state.items()}
        full = self._exchange_state(local)
        full.update(local)  # our own entries stay the live tensors, as in a plain optimizer
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [self._index[id(p)] for p in g["params"]]
            groups.append(packed)
        return {"state": {i: full[i] for i in sorted(full)}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (unsharded) state dict; call with the same dict on every rank.

        Restores the global groups' hyper-parameters and gives the inner optimizer only the
        entries of parameters this rank owns. No communication.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("state dict's parameter groups do not match this optimizer's")
        # Saved indices are positional: the k-th saved param is our k-th param.
        saved_to_param = {
            i: p
            for s, g in zip(saved_groups, self.param_groups)
            for i, p in zip(s["params"], g["params"])
        }
        for saved, group in zip(saved_groups, self.param_groups):
            group.update((k, v) for k, v in saved.items() if k != "params")
        local_groups = [self._local_group(g) for g in self.param_groups]
        local_index = {id(p): i for i, p in enumerate(p for g in local_groups for p in g["params"])}
        local_state = {}
        for i, s in state_dict["state"].items():
            p = saved_to_param[i]
            if id(p) in local_index:
                local_state[local_index[id(p)]] = s
        for g in local_groups:
            g["params"] = [local_index[id(p)] for p in g["params"]]
        self.inner.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.inner.state  # load_state_dict replaced the inner state dict

    # ----- communication helpers -----

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _exchange_state(self, outgoing: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """All-gather {global index: per-param state}; returns the union of every rank's.

        Tensors travel as CPU bytes (exact) and land on the receiver's parameter device if
        they were on the sender's parameter device; other values travel as they are.
        """
        if self.world_size == 1:
            return dict(outgoing)
        packed = {
            i: {
                k: _Packed(v.cpu(), v.device == self._params[i].device)
                if isinstance(v, torch.Tensor)
                else v
                for k, v in s.items()
            }
            for i, s in outgoing.items()
        }
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, packed, group=self.process_group)
        merged = {}
        for part in gathered:
            for i, s in part.items():
                device = self._params[i].device
                merged[i] = {
                    k: (v.tensor.to(device) if v.on_param_device else v.tensor)
                    if isinstance(v, _Packed)
                    else v
                    for k, v in s.items()
                }
        return merged
