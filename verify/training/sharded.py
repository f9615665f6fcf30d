"""Full tensors from an implementation whose ranks hold only their shard of them.

The checks judge sharded data parallelism on full tensors (docs/verify-your-own-ddp.md): after the
synchronization, every trainable parameter's averaged gradient, the same on every rank,
compared with one process. How the tool gets them, in order (docs/verify-your-own-ddp.md):

1. the wrapper has `full_gradients()`: a collective the tool calls on every rank after
   `finish_gradient_synchronization()`, returning `{name: gradient or None}` for every
   trainable parameter, named as the wrapped module's `named_parameters()` names it, each
   gradient whole (ZeRO-2, `impls.zero2`, sends each from its owner);
2. a gradient that is a `DTensor` (PyTorch FSDP2's): `.full_tensor()`, a collective (over
   gloo on CUDA, `gather_shards` instead: see `_full`);
3. otherwise `.grad` as it is (replicated data parallelism).

Parameters the same way (`full_parameters`): the wrapper's `full_parameters()` when it has
one (a collective returning `{name: whole parameter}` for every parameter; ZeRO-3,
`impls.zero3`), else a `DTensor` by `.full_tensor()` (or `gather_shards`), else as it is
(replicated).

A `full_gradients()` whose answer does not fit (a name missing or unknown, a value that is not
a tensor) cannot be judged: `InterfaceError`, one line, exit 2. A gradient of the wrong shape
(a rank's shard, not the whole) is judged: the checks report it as a finding of the class.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from verify.training.interface import InterfaceError

GUIDE = "docs/verify-your-own-ddp.md"


def full_gradients(model: nn.Module, wrapped: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's full gradient by name (module docstring). A collective
    when the implementation is sharded: call on every rank, in the same place."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    gather = getattr(wrapped, "full_gradients", None)
    if gather is None:
        return {n: _full(p.grad) for n, p in trainable.items()}
    got = gather()
    problem = _misfit(got, trainable)
    if problem:
        raise InterfaceError(
            f"{type(wrapped).__name__}.full_gradients() {problem}; it must return "
            "{name: gradient or None} for every trainable parameter, named as the wrapped "
            f"module's named_parameters() names it (see {GUIDE})"
        )
    return {n: _full(got[n]) for n in trainable}


def full_state(
    named: list[tuple[str, torch.Tensor | None]], model: nn.Module, wrapped: nn.Module
) -> list[tuple[str, torch.Tensor | None]]:
    """An audit's `param:NAME` / `buffer:NAME` / ... list with every parameter whole
    (`full_parameters`) and every other DTensor put together. A collective."""
    params = full_parameters(model, wrapped)
    named = [
        (k, params.get(k.removeprefix("param:"), t) if k.startswith("param:") else t)
        for k, t in named
    ]
    return full_named(named)


def full_parameters(model: nn.Module, wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (module docstring). A collective when sharded."""
    gather = getattr(wrapped, "full_parameters", None)
    if gather is None:
        return {n: _full(p) for n, p in model.named_parameters()}
    got = gather()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if not isinstance(got, dict) or set(got) != set(shapes):
        raise InterfaceError(
            f"{type(wrapped).__name__}.full_parameters() must return {{name: whole parameter}}"
            " for every parameter, named as the wrapped module's named_parameters() names it "
            f"(see {GUIDE})"
        )
    return {n: got[n] for n in shapes}


def full_named(
    named: list[tuple[str, torch.Tensor | None]],
) -> list[tuple[str, torch.Tensor | None]]:
    """`named` with every DTensor replaced by its full tensor (a collective per DTensor, in
    list order: every rank must pass the same names)."""
    return [(name, _full(tensor)) for name, tensor in named]


@torch.no_grad()
def assign_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full tensor `full` into `target`, a DTensor's local shard taken from it."""
    if hasattr(target, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.to(target.device), target.device_mesh, target.placements)
    target.copy_(full)


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor put together from its shards (a collective); any other tensor as it is."""
    if tensor is None or not hasattr(tensor, "full_tensor"):
        return tensor
    if tensor.device.type == "cuda" and _one_dim(tensor) and _not_nccl(tensor):
        # `full_tensor()` all-gathers through `allgather_into_tensor_coalesced`, which gloo
        # kills the process with on CUDA tensors (SIGSEGV; torch 2.11, one H100: two ranks
        # sharing the GPU, `--device cuda --backend gloo`). FSDP2 itself never calls it.
        return gather_shards(tensor)
    return tensor.full_tensor()


def row_block(tensor) -> tuple[int, int] | None:
    """(d, ceil(n / N)) of a DTensor placed `Shard(d)` on a one-dimensional mesh of N ranks,
    n its size along d; None for any other tensor or placement. `Shard(d)` cuts d as
    `torch.chunk` does: every rank holds that many rows but the last ones, which hold fewer
    or none, so rank r's rows start at r x ceil(n / N)."""
    placements = getattr(tensor, "placements", None)
    if placements is None or len(placements) != 1 or not placements[0].is_shard():
        return None
    dim = placements[0].dim
    return dim, -(-tensor.shape[dim] // tensor.device_mesh.size())


@torch.no_grad()
def gather_shards(tensor) -> torch.Tensor:
    """The full tensor of a DTensor on a one-dimensional mesh, sharded on one dimension or
    replicated, by one plain `all_gather_into_tensor` of the shards padded to one length
    (`row_block`: the first n rows of the padded gather are the full tensor). A collective
    over the mesh's group."""
    local = tensor.to_local().detach()
    block = row_block(tensor)
    if block is None:  # replicated
        return local
    (dim, chunk), group = block, tensor.device_mesh.get_group()
    rows, size = tensor.shape[dim], dist.get_world_size(group)
    mine = local.movedim(dim, 0)
    padded = mine.new_zeros((chunk, *mine.shape[1:]))
    padded[: len(mine)] = mine
    out = mine.new_empty((size * chunk, *mine.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[:rows].movedim(0, dim).contiguous()


def _one_dim(tensor) -> bool:
    placements = tensor.placements
    return len(placements) == 1 and (placements[0].is_shard() or placements[0].is_replicate())


def _not_nccl(tensor) -> bool:
    return "nccl" not in str(dist.get_backend(tensor.device_mesh.get_group()))


def _misfit(got: object, trainable: dict[str, nn.Parameter]) -> str:
    if not isinstance(got, dict):
        return f"returned a {type(got).__name__}, not a dict"
    missing = [n for n in trainable if n not in got]
    if missing:
        return f"left out {missing[0]!r}" + (f" and {len(missing) - 1} more" if missing[1:] else "")
    unknown = [n for n in got if n not in trainable]
    if unknown:
        return f"named {unknown[0]!r}, not a trainable parameter of the wrapped module"
    for name, grad in got.items():
        if grad is not None and not isinstance(grad, torch.Tensor):
            return f"gave a {type(grad).__name__} for {name!r}"
    return ""
