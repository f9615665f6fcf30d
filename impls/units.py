"""ZeRO-3's unit of communication: one block's parameters, sharded by rows, and the two
collectives that move them, each launched asynchronously and owning its handle.

A `Unit` holds this rank's row shard of every parameter of a block (the module's parameters
between uses), one flat buffer the full parameters are gathered into (its memory freed between
uses), and the full parameters as leaves whose memory is that buffer:

- `start_gather()` launches the all-gather of the shards (async); `gather()` waits for it, or
  gathers now, and lays the result out parameter by parameter in the buffer;
- `start_reduce_scatter()` launches the reduce-scatter of the leaves' gradients (async, the
  gradients moved into its input buffer); `wait_reduce_scatter()` waits and frees that input;
  `reduced_grads()` reads this rank's rows of the sum.

The memory a collective was handed is never touched until it is waited on: `free()` waits for
a gather in flight before it frees the buffer, and nothing reads a reduce-scatter's output
before `wait_reduce_scatter()` (what `--sanitize` checks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

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
        # (handle, staged output, input) of the all-gather in flight; None when none is
        self.gathering: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None
        # the reduce-scatter: (handle, input) while in flight; its output; which leaves had a
        # gradient on this rank (None: not launched since the last `reduced_grads`)
        self.reducing: tuple[dist.Work | None, torch.Tensor] | None = None
        self.reduced: torch.Tensor | None = None
        self.used: list[bool] | None = None
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

    # --- parameters: all-gather ------------------------------------------------------------

    @torch.no_grad()
    def start_gather(self, group) -> None:
        """Launch the all-gather of the shards (async; a collective); a no-op when the unit is
        gathered or its gather is in flight. The buffer's memory is allocated here."""
        if self.gathered or self.gathering is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        mine = torch.cat([s.detach().reshape(-1) for s in self.shards])
        if self.world_size == 1:
            self.full.copy_(mine)
            self.gathered = True
            return
        staged = torch.empty_like(self.full)  # rank-major: [rank][param chunks]
        handle = dist.all_gather_into_tensor(staged, mine, group=group, async_op=True)
        self.gathering = (handle, staged, mine)  # both alive until the gather completes

    @torch.no_grad()
    def gather(self, group) -> None:
        """The full parameters in the buffer on return: waits for the gather in flight, or
        gathers now (a collective then); idempotent."""
        self.start_gather(group)
        if self.gathering is not None:
            handle, staged, _ = self.gathering
            handle.wait()
            self.gathering = None
            self._unstage(staged, self.full)
        self.gathered = True

    def free(self) -> None:
        """Free the buffer's memory (after the gather in flight, if one is: never under it)."""
        if self.gathering is not None:
            self.gathering[0].wait()
            self.gathering = None
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def assemble(self, local: list[torch.Tensor], group, out: torch.Tensor) -> torch.Tensor:
        """All-gather this rank's `local` blocks (one per parameter, shard-shaped) into `out`,
        laid out parameter by parameter, each its padded full rows (a blocking collective)."""
        mine = torch.cat([t.reshape(-1) for t in local]) if local else out.new_empty(0)
        if self.world_size == 1:
            return out.copy_(mine)
        staged = torch.empty_like(out)
        dist.all_gather_into_tensor(staged, mine, group=group)
        return self._unstage(staged, out)

    def _unstage(self, staged: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy a rank-major gather ([rank][param chunks]) into `out`, parameter-major."""
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

    # --- gradients: reduce-scatter ---------------------------------------------------------

    @torch.no_grad()
    def start_reduce_scatter(self, group, divide_by: int) -> None:
        """Launch the reduce-scatter (async; a collective) of the leaves' gradients, divided on
        the way in by `divide_by` (the world size: the average); a leaf with no gradient
        contributes zeros. The leaves' `.grad` are dropped: the input buffer holds them."""
        grads = torch.zeros(
            self.total * self.world_size, dtype=self.full.dtype, device=self.full.device
        )
        ranks = grads.view(self.world_size, self.total)
        start, self.used = 0, []
        for leaf, chunk in zip(self.leaves, self.chunk):
            self.used.append(leaf.grad is not None)
            if leaf.grad is not None:
                padded = torch.zeros(
                    chunk * self.world_size, dtype=grads.dtype, device=grads.device
                )
                torch.div(leaf.grad.reshape(-1), divide_by, out=padded[: leaf.numel()])
                ranks[:, start : start + chunk].copy_(padded.view(self.world_size, chunk))
            leaf.grad = None
            start += chunk
        if self.world_size == 1:
            self.reduced = grads
            return
        self.reduced = grads.new_empty(self.total)
        handle = dist.reduce_scatter_tensor(self.reduced, grads, group=group, async_op=True)
        self.reducing = (handle, grads)

    def wait_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter in flight, if one is, and free its input."""
        if self.reducing is not None:
            self.reducing[0].wait()
            self.reducing = None

    def reduced_grads(self, flags: list[int]) -> list[torch.Tensor | None]:
        """This rank's rows of each summed gradient (after `wait_reduce_scatter`), None where
        `flags` (the all-reduced `used`) says no rank produced one; forgets the result."""
        out, start = [], 0
        for shard, chunk, flag in zip(self.shards, self.chunk, flags):
            out.append(self.reduced[start : start + chunk].view_as(shard) if flag else None)
            start += chunk
        self.reduced = self.used = None
        return out


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


def refuse_unshardable(params: list[nn.Parameter], names: list[str]) -> None:
    """ZeRO-3's refusals at construction: a 0-dim parameter (no rows to cut), a unit whose
    parameters mix dtypes (it is gathered in one buffer)."""
    for p, name in zip(params, names):
        if p.dim() == 0:
            raise ValueError(f"zero3 shards parameters by rows; {name} is 0-dim (has no rows)")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"zero3 gathers a unit in one buffer; the unit of {names[0]} mixes dtypes "
            f"{sorted(str(d) for d in dtypes)}"
        )
