"""ZeRO-3 (FSDP-style): parameters sharded too, gathered unit by unit around their use; the
next unit's gather and each unit's reduce-scatter overlap computation.

What is communicated, when, and at what cost:
- construction: parameters and buffers are broadcast from rank 0; then every trainable
  parameter is cut along dim 0 into N row blocks of ceil(rows / N) rows (the last padded with
  zero rows, `shard_rows`), and each rank keeps its block as the parameter, under the same
  name, so optimizers and parameter groups see the shards (as PyTorch's FSDP2 does);
- forward: units are planned once (a unit per block: a child of the root, or of a child
  container without a forward; the rest, tied weights included, in the root unit; `Unit` in
  `units.py`). The root's unit is all-gathered for the whole forward. Before a block's
  forward, its all-gather (one, of the concatenated shards of its parameters, into one buffer)
  is waited on, and the all-gather of the unit that came next in the last forward (the plan's
  order at the first) is launched, async: it runs while this block computes (prefetch). After
  a block's forward its buffer's memory is freed. Tensors autograd saves for backward that
  live in a buffer are saved as where they are, not as memory;
- backward: the first time a unit's saved tensor is needed, the unit is all-gathered again
  (its prefetched gather waited on), and the gather of the unit first needed after it in the
  last backward (at the first: the root's, then the forward's order reversed) is launched.
  When every full parameter of a unit has its gradient (a post-accumulate-grad hook counts
  them), the unit's buffer is freed and, in a synchronized step, one async reduce-scatter of
  its gradients (divided by N on the way in) is launched: it runs while the units before it
  compute their backward. At most 2 are in flight: launching a third waits for the oldest;
- in `finish_gradient_synchronization()`: a unit some of whose parameters got no gradient on
  this rank is launched now (zeros for them); one all-reduce of which parameters got one on
  any rank; every reduce-scatter waited on; each rank's rows become its shards' `.grad` (None
  where no rank produced one). `no_sync()` accumulates full gradients on the full parameters
  and communicates no gradient (the parameters are still gathered: compute needs them);
- collectives per step: per unit 1 reduce-scatter and 2 all-gathers at most (a unit none of
  whose full parameters autograd saved, e.g. a first layer whose input needs no gradient, is
  not gathered for backward once the backward's order is learned), 1 all-reduce of flags;
- memory: outside the forward and backward, parameters, gradients and (a plain optimizer over
  the shards) optimizer state about 1/N each, plus padding of at most N - 1 rows per
  parameter. In forward: the root's unit plus at most 2 units gathered (the one computing, the
  one prefetched; a gather in flight also holds a staging copy). In backward: the unit
  computing and the one prefetched (the root's too while its parameters are needed; a unit
  stays gathered until all its parameters have their gradient), the full gradients of the
  units whose backward runs, and the inputs of at most 2 reduce-scatters in flight (one
  unit's full gradients each).

The rule that keeps it correct: every rank issues the same collectives in the same order.
Prefetches follow orders recorded alike on every rank; gathers and reduce-scatters in backward
come where the backward needs and completes units, the same place on every rank because every
rank runs the same graph. Refused at construction, with one line: parameters unused on some
ranks (told by the tool's hint: their unit would be gathered and reduce-scattered on some
ranks only, as PyTorch's FSDP refuses them too), parameters with no dim 0 to cut (0-dim), and a
unit whose parameters mix dtypes. Frozen parameters are not sharded: they stay whole on every
rank (broadcast at construction).

Checkpoints are per-rank: between steps the module's parameters are this rank's row shards
(padded), so `wrapper.module.state_dict()` holds them under the module's names, and
`load_state_dict()` of the same rank's dict into a fresh wrapper of the same world size puts
them back (as FSDP's local state dicts, and torch.distributed.checkpoint's one shard per rank).
Whole parameters, for a checkpoint that does not depend on the world size: `full_parameters()`.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallel, broadcast_coalesced
from .units import Unit, plan_units, refuse_unshardable, shard_rows

__all__ = ["Zero3DDP", "plan_units", "shard_rows", "zero3_wrap"]

#: reduce-scatters in flight at once; launching one more waits for the oldest (its input freed)
MAX_REDUCE_SCATTERS_IN_FLIGHT = 2


class _Saved:
    """A tensor autograd saved that lives in a unit's full buffer: kept as where it is."""

    def __init__(self, unit: Unit, t: torch.Tensor) -> None:
        self.unit, self.size, self.stride = unit, t.size(), t.stride()
        self.offset = t.storage_offset()


class Zero3DDP(DataParallel):
    """Parameters sharded by rows, gathered per unit around forward and backward, the next
    unit prefetched and gradients reduce-scattered per unit during backward (module
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
        self_ref = weakref.ref(self)  # the hooks must not keep the wrapper alive
        for block, params in plan_units(module):
            refuse_unshardable(params, [names[id(p)] for p in params])
            unit = Unit([slots[id(p)] for p in params], params, self.world_size, self.rank)
            unit.install(unit.shards)  # from here on the module's parameters are the shards
            self.units.append(unit)
            self.unit_names.append([names[id(p)] for p in params])
            for leaf in unit.leaves:
                leaf.register_post_accumulate_grad_hook(_leaf_hook(self_ref, unit))
            if block is None:
                self.root_unit = unit
            else:
                block.register_forward_pre_hook(lambda m, args, unit=unit: self._before(unit))
                block.register_forward_hook(lambda m, args, out, unit=unit: self._reshard(unit))
        # The orders prefetching follows: the units in the order the last forward ran them
        # (the plan's at first), and the order the last backward first needed them.
        self._forward_order = [u for u in self.units if u is not self.root_unit]
        self._backward_order: list[Unit] | None = None
        self._ran: list[Unit] = []  # this forward's order so far
        self._needed: list[Unit] = []  # this backward's order so far
        self._missing = {u: len(u.leaves) for u in self.units}  # gradients still to come
        self._launched: list[Unit] = []  # reduce-scatters launched this step, in order

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            broadcast_coalesced(list(self.module.buffers()), self.process_group)
        if self._needed:  # a backward ran since the last forward: its order predicts the next
            self._backward_order, self._needed = self._needed, []
        self._missing = {u: len(u.leaves) for u in self.units}
        root = self.root_unit
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            if root is not None:
                self._unshard(root)
            self._prefetch(self._forward_order, 0)
            try:
                return self.module(*args, **kwargs)
            finally:
                if root is not None:
                    self._reshard(root)
                self._forward_order, self._ran = self._ran, []
                for unit in self.units:  # a prefetch this forward did not use (its order changed)
                    unit.free()

    def _before(self, unit: Unit) -> None:
        """Before a block's forward: its parameters put together, the next unit's launched."""
        self._ran.append(unit)
        self._unshard(unit)
        self._prefetch(self._forward_order, len(self._ran))

    def _unshard(self, unit: Unit) -> None:
        """Before a unit's forward: its full parameters gathered (the prefetch waited on, or
        a gather now) and put in the modules."""
        unit.gather(self.process_group)
        unit.install(unit.leaves)

    def _reshard(self, unit: Unit) -> None:
        """After a unit's forward: the shards put back, the full buffer's memory freed."""
        unit.install(unit.shards)
        unit.free()

    def _prefetch(self, order: list[Unit], k: int, done: tuple | list[Unit] = ()) -> None:
        """Launch the gather (async) of `order[k]`, the unit predicted to be needed next,
        unless its backward already ran (`done`). A prediction is only a guess of what to
        fetch early: every rank makes the same one, so the collectives still match."""
        if k < len(order) and order[k] not in done:
            index = self.units.index(order[k])
            with torch.profiler.record_function(f"{type(self).__name__}.prefetch[{index}]"):
                order[k].start_gather(self.process_group)

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
        self._regather(saved.unit)  # all-gathered again for backward
        return saved.unit.full.as_strided(saved.size, saved.stride, saved.offset)

    def _regather(self, unit: Unit) -> None:
        """In backward: `unit` gathered; the first time, the next unit's gather launched."""
        first = unit not in self._needed
        if first:
            self._needed.append(unit)
        unit.gather(self.process_group)
        if first:
            order = self._backward_order
            if order is None:  # no backward yet: the root's unit, then the forward reversed
                root = [self.root_unit] if self.root_unit is not None else []
                order = root + self._forward_order[::-1]
            self._prefetch(order, len(self._needed), done=self._needed)

    # --- synchronization -----------------------------------------------------------------

    def _on_gradient(self, unit: Unit) -> None:
        """A full parameter of `unit` has its gradient of this backward (accumulated)."""
        if unit.used is not None:
            raise RuntimeError(
                "Zero3DDP: a parameter got a gradient after its unit's reduce-scatter was "
                "launched; call backward once per synchronized step (use no_sync() to accumulate)"
            )
        self._missing[unit] -= 1
        if self._missing[unit] == 0:  # the unit's backward is over (a later need gathers again)
            if self.require_backward_grad_sync:
                self._launch(unit)
            unit.free()

    def _launch(self, unit: Unit) -> None:
        with torch.profiler.record_function(
            f"{type(self).__name__}.reduce_scatter[{self.units.index(unit)}]"
        ):
            self._reduce_scatter(unit)
        self._launched.append(unit)
        if len(self._launched) > MAX_REDUCE_SCATTERS_IN_FLIGHT:  # bound the inputs' memory
            self._launched[-MAX_REDUCE_SCATTERS_IN_FLIGHT - 1].wait_reduce_scatter()

    def _reduce_scatter(self, unit: Unit) -> None:
        """Launch `unit`'s reduce-scatter, its gradients divided by N on the way in: the
        average lands on each rank's rows."""
        unit.start_reduce_scatter(self.process_group, divide_by=self.world_size)

    def _finish_synchronization(self) -> None:
        for unit in self.units:  # gradients missing on this rank: launched now, in unit order
            if unit.used is None:
                self._launch(unit)
        used = [u for unit in self.units for u in unit.used]  # got a gradient on this rank
        if self.world_size > 1 and used:  # after every reduce-scatter: the same place on all
            flags = torch.tensor(used, dtype=torch.int32, device=self.units[0].full.device)
            dist.all_reduce(flags, group=self.process_group)
            used = flags.tolist()
        for unit in self.units:  # nothing written back while a collective is on the wire
            unit.wait_reduce_scatter()
        start = 0
        for unit in self.units:
            count = len(unit.shards)
            for shard, grad in zip(unit.shards, unit.reduced_grads(used[start : start + count])):
                if grad is not None:  # no rank produced one: untouched, as DDP leaves it
                    self._set_grad(shard, grad)
            start += count
            unit.free()
        self._launched = []

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

    def shard_rows(self) -> dict[str, tuple[int, int]]:
        """The rows of each sharded parameter this rank holds, by name: `(start, stop)`, held
        as the first `stop - start` rows of its shard (the rest is padding; empty on a rank
        past the last row). Frozen parameters are whole, so not named. Local: no collective."""
        rows = {}
        for unit, names in zip(self.units, self.unit_names):
            for name, shape in zip(names, unit.shapes):
                block = shard_rows(shape[0], self.world_size)
                start = min(self.rank * block, shape[0])
                rows[name] = (start, min(start + block, shape[0]))
        return rows

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


def _leaf_hook(wrapper_ref: weakref.ref, unit: Unit):
    def hook(leaf: torch.Tensor) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper._on_gradient(unit)

    return hook


def zero3_wrap(module, *, process_group=None, find_unused_parameters=False, **_hints):
    """The registry's recipe: `Zero3DDP`, told whether the workload leaves parameters unused."""
    return Zero3DDP(
        module, process_group=process_group, find_unused_parameters=find_unused_parameters
    )
