"""ZeRO-3 (FSDP-style): parameters sharded too, gathered unit by unit around their use.

What is communicated, when, and at what cost:
- construction: parameters and buffers are broadcast from rank 0; then every trainable
  parameter is cut along dim 0 into N row blocks of ceil(rows / N) rows (the last padded with
  zero rows, `shard_rows`), and each rank keeps its block as the parameter, under the same
  name, so optimizers and parameter groups see the shards (as PyTorch's FSDP2 does);
- forward: units are planned once (a unit per block: a child of the root, or of a child
  container without a forward; the rest, tied weights included, in the root unit). Before a
  unit's forward, one all-gather of the concatenated shards of its parameters puts the full
  parameters together in one buffer; after it, the buffer's memory is freed. Tensors autograd
  saves for backward that live in that buffer are saved as where they are, not as memory;
- backward: the first time a unit's saved tensor is needed, the unit is all-gathered again;
- in `finish_gradient_synchronization()`: per unit, one reduce-scatter of the full gradients
  (divided by N on the way in) leaves each rank its rows; the full buffers and gradients are
  freed. `no_sync()` accumulates full gradients locally and communicates nothing;
- collectives per step: 2 all-gathers and 1 reduce-scatter per unit; memory outside a
  gathered unit: parameters, gradients and (a plain optimizer over the shards) optimizer state
  about 1/N each, plus padding of at most N - 1 rows per parameter.

Refused at construction, with one line: parameters with no dim 0 to cut (0-dim), a unit
whose parameters mix dtypes, and (told by the tool's hint) parameters unused on some ranks,
whose unit would then be gathered on some ranks only, as PyTorch's FSDP refuses them too.
Frozen parameters are not sharded: they stay whole on every rank (broadcast at construction).
Not done here: prefetching the next unit's gather, and launching the reduce-scatter of a unit
while the backward of earlier units runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallel, broadcast_coalesced
from .recipes import fsdp_blocks


def shard_rows(rows: int, world_size: int) -> int:
    """Rows each rank keeps of a parameter with `rows` rows: ceil(rows / N), padded."""
    return -(-rows // world_size)


class Unit:
    """One unit's parameters: their row shards (the module's parameters) and the buffer the
    full parameters are gathered into (memory freed between uses)."""

    def __init__(self, slots: list[list[tuple[nn.Module, str]]], params, world_size, rank):
        self.slots, self.world_size, self.rank = slots, world_size, rank
        self.shapes = [tuple(p.shape) for p in params]
        self.chunk = [shard_rows(p.shape[0], world_size) * p[0].numel() for p in params]
        self.total = sum(self.chunk)  # elements of this rank's concatenated shards
        dtype, device = params[0].dtype, params[0].device
        self.full = torch.empty(self.total * world_size, dtype=dtype, device=device)
        self.shards: list[nn.Parameter] = []
        for p, chunk in zip(params, self.chunk):
            padded = torch.zeros(chunk * world_size, dtype=dtype, device=device)
            padded[: p.numel()] = p.detach().reshape(-1)
            rows = (shard_rows(p.shape[0], world_size), *p.shape[1:])
            block = padded[rank * chunk : (rank + 1) * chunk].clone().view(rows)
            self.shards.append(nn.Parameter(block))
        # Full parameters: leaves (gradients accumulate on them across micro-steps) whose
        # memory is the full buffer's, laid out param by param (rank-major inside each).
        self.leaves = [self._leaf(i) for i in range(len(params))]
        self.gathered = False
        self.free()

    def _leaf(self, i: int) -> torch.Tensor:
        # set_, not a view: a view would share the buffer's version counter, and every gather
        # into the buffer would look to autograd like an in-place change of the parameter.
        offset = sum(self.chunk[:i]) * self.world_size
        leaf = torch.empty(0, dtype=self.full.dtype, device=self.full.device)
        leaf.set_(self.full.untyped_storage(), offset, self.shapes[i])
        return leaf.requires_grad_(True)

    def install(self, tensors: list[torch.Tensor]) -> None:
        """Put `tensors` (the shards, or the full leaves) in every module slot of the unit."""
        for slots, t in zip(self.slots, tensors):
            for module, name in slots:
                module._parameters[name] = t

    @torch.no_grad()
    def gather(self, group) -> None:
        """All-gather the shards into the full buffer (a collective); idempotent."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.assemble([s.detach() for s in self.shards], group, out=self.full)
        self.gathered = True

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def assemble(self, local: list[torch.Tensor], group, out: torch.Tensor) -> torch.Tensor:
        """All-gather this rank's `local` blocks (one per parameter, shard-shaped) into `out`,
        laid out parameter by parameter, each its padded full rows (a collective)."""
        mine = torch.cat([t.reshape(-1) for t in local]) if local else out.new_empty(0)
        if self.world_size == 1:
            return out.copy_(mine)
        staged = torch.empty_like(out)  # rank-major: [rank][param chunks]
        dist.all_gather_into_tensor(staged, mine, group=group)
        ranks, start = staged.view(self.world_size, self.total), 0
        for chunk in self.chunk:
            dst = out[start * self.world_size : (start + chunk) * self.world_size]
            dst.view(self.world_size, chunk).copy_(ranks[:, start : start + chunk])
            start += chunk
        return out

    def full_view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i, unpadded, in a parameter-major `buffer` (as `assemble` fills it)."""
        offset = sum(self.chunk[:i]) * self.world_size
        return buffer[offset : offset + torch.Size(self.shapes[i]).numel()].view(self.shapes[i])

    @torch.no_grad()
    def reduce_scatter(self, group, divide_by: int) -> list[torch.Tensor | None]:
        """Each shard's gradient summed over ranks, divided on the way in by `divide_by` (the
        world size: the average); None where no rank produced one (an all-reduced flag)."""
        grads = torch.zeros(
            self.total * self.world_size, dtype=self.full.dtype, device=self.full.device
        )
        ranks = grads.view(self.world_size, self.total)
        start, used = 0, []
        for leaf, chunk in zip(self.leaves, self.chunk):
            used.append(leaf.grad is not None)
            if leaf.grad is not None:
                padded = torch.zeros(
                    chunk * self.world_size, dtype=grads.dtype, device=grads.device
                )
                torch.div(leaf.grad.reshape(-1), divide_by, out=padded[: leaf.numel()])
                ranks[:, start : start + chunk].copy_(padded.view(self.world_size, chunk))
            leaf.grad = None
            start += chunk
        flags = torch.tensor(used, dtype=torch.int32, device=grads.device)
        mine = torch.empty(self.total, dtype=grads.dtype, device=grads.device)
        if self.world_size == 1:
            mine.copy_(grads)
        else:
            dist.all_reduce(flags, group=group)
            dist.reduce_scatter_tensor(mine, grads.view(-1), group=group)
        out, start = [], 0
        for shard, chunk, flag in zip(self.shards, self.chunk, flags.tolist()):
            out.append(mine[start : start + chunk].view_as(shard) if flag else None)
            start += chunk
        return out


class _Saved:
    """A tensor autograd saved that lives in a unit's full buffer: kept as where it is."""

    def __init__(self, unit: Unit, t: torch.Tensor) -> None:
        self.unit, self.size, self.stride = unit, t.size(), t.stride()
        self.offset = t.storage_offset()


class Zero3DDP(DataParallel):
    """Parameters sharded by rows, gathered per unit around forward and backward (module
    docstring). Build the optimizer over `module.parameters()` after wrapping: they are the
    shards (a plain optimizer then keeps 1/N of the state).

    Args:
        module: the model replica on this rank (its trainable parameters become shards).
        process_group: the group the model is sharded over (default: the world group).
        broadcast_buffers: broadcast buffers from rank 0 before every forward.
        find_unused_parameters: the caller's word that some parameters go unused on some
            ranks: refused (module docstring).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        if find_unused_parameters:
            raise ValueError(
                "zero3 cannot train parameters unused on some ranks: their unit would be "
                "gathered on some ranks only"
            )
        super().__init__(module, process_group=process_group, broadcast_buffers=broadcast_buffers)
        self.rank = dist.get_rank(self.process_group)
        names = {id(p): n for n, p in module.named_parameters()}
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        for m in module.modules():  # every place a parameter sits: a tied one sits in two
            for name, p in m._parameters.items():
                if p is not None:
                    slots.setdefault(id(p), []).append((m, name))
        self.units: list[Unit] = []
        self.unit_names: list[list[str]] = []
        self.root_unit: Unit | None = None
        for block, params in plan_units(module):
            _refuse_unshardable(params, [names[id(p)] for p in params])
            unit = Unit([slots[id(p)] for p in params], params, self.world_size, self.rank)
            unit.install(unit.shards)  # from here on the module's parameters are the shards
            self.units.append(unit)
            self.unit_names.append([names[id(p)] for p in params])
            if block is None:
                self.root_unit = unit
            else:
                block.register_forward_pre_hook(lambda m, args, unit=unit: self._unshard(unit))
                block.register_forward_hook(lambda m, args, out, unit=unit: self._reshard(unit))

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            broadcast_coalesced(list(self.module.buffers()), self.process_group)
        root = self.root_unit
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            if root is not None:
                self._unshard(root)
            try:
                return self.module(*args, **kwargs)
            finally:
                if root is not None:
                    self._reshard(root)

    def _unshard(self, unit: Unit) -> None:
        """Before a unit's forward: its full parameters gathered and put in the modules."""
        unit.gather(self.process_group)
        unit.install(unit.leaves)

    def _reshard(self, unit: Unit) -> None:
        """After a unit's forward: the shards put back, the full buffer's memory freed."""
        unit.install(unit.shards)
        unit.free()

    # --- saved tensors: kept as where they are in a unit's buffer, not as memory ------------

    def _pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # no storage to compare (sparse, meta): keep it as it is
            return t
        for unit in self.units:
            if unit.gathered and ptr == unit.full.untyped_storage().data_ptr() and ptr:
                return _Saved(unit, t)
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        saved.unit.gather(self.process_group)  # all-gathered again for backward
        return saved.unit.full.as_strided(saved.size, saved.stride, saved.offset)

    # --- synchronization -----------------------------------------------------------------

    def _finish_synchronization(self) -> None:
        for unit in self.units:
            grads = unit.reduce_scatter(self.process_group, divide_by=self.world_size)
            for shard, grad in zip(unit.shards, grads):
                if grad is not None:  # no rank produced one: untouched, as DDP leaves it
                    self._set_grad(shard, grad)
            unit.free()

    # --- full tensors, for checkers (docs/verify-your-own-ddp.md) --------------------------

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by the wrapped module's names (a collective)."""
        full = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        for unit, names in zip(self.units, self.unit_names):
            was = unit.gathered
            unit.gather(self.process_group)
            for i, name in enumerate(names):
                full[name] = unit.full_view(unit.full, i).clone()
            if not was:
                unit.free()
        return full

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every trainable parameter's averaged gradient, whole (a collective); None where no
        rank holds one."""
        full: dict[str, torch.Tensor | None] = {}
        for unit, names in zip(self.units, self.unit_names):
            present = [s.grad is not None for s in unit.shards]
            flags = torch.tensor(present, dtype=torch.int32, device=unit.full.device)
            if self.world_size > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.process_group)
            local = [s.grad if s.grad is not None else torch.zeros_like(s) for s in unit.shards]
            buffer = unit.assemble(local, self.process_group, out=torch.empty_like(unit.full))
            for i, (name, flag) in enumerate(zip(names, flags.tolist())):
                full[name] = unit.full_view(buffer, i).clone() if flag else None
        return full


def plan_units(module: nn.Module) -> list[tuple[nn.Module | None, list[nn.Parameter]]]:
    """(block, its trainable parameters) per unit, blocks as `fsdp_blocks` picks them, then
    (None, the rest): the root's unit, tied weights included."""
    units, taken = [], set()
    for block in fsdp_blocks(module):
        params = [p for p in block.parameters() if p.requires_grad]
        if params:
            units.append((block, params))
            taken |= {id(p) for p in params}
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in taken]
    if rest:
        units.append((None, rest))
    return units


def _refuse_unshardable(params: list[nn.Parameter], names: list[str]) -> None:
    for p, name in zip(params, names):
        if p.dim() == 0:
            raise ValueError(f"zero3 shards parameters by rows; {name} is 0-dim (has no rows)")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"zero3 gathers a unit in one buffer; the unit of {names[0]} mixes dtypes "
            f"{sorted(str(d) for d in dtypes)}"
        )


def zero3_wrap(module, *, process_group=None, find_unused_parameters=False, **_hints):
    """The registry's recipe: `Zero3DDP`, told whether the workload leaves parameters unused."""
    return Zero3DDP(
        module, process_group=process_group, find_unused_parameters=find_unused_parameters
    )
