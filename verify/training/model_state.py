"""The model's `state_dict()` round trip: save, build a fresh wrapper, load, train on.

Resuming must not change training, for the model as for the optimizer (`checkpoint.py`). The
round trip plays what a user saves:

- the wrapper's own `state_dict()` / `load_state_dict()` when its class defines them (a
  sharded wrapper that gathers, or cuts, its own checkpoint), else the wrapped module's
  (`wrapper.module`, as with PyTorch's DDP), else the wrapper's as nn.Module gives it (FSDP2's
  `fully_shard` returns the module itself);
- "full" when every rank's dict is the same (replicated data parallelism, or a sharded class
  that gathers): rank 0's is loaded on every rank, as a checkpoint written by rank 0 would be;
- "per-rank" when it holds DTensors (FSDP2's sharded state dict) or differs between ranks
  (ZeRO-3's row shards under the module's names): each rank loads its own, as
  torch.distributed.checkpoint would.

The fresh model is built from another seed than the first (and broadcast from rank 0 by the
wrapper, as at construction), so state the load loses shows: the next step diverges from the
single-process reference. A call into the user's code that raises comes back as a
`checkpoint.CheckpointError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from verify.training.checkpoint import (
    CheckpointError,
    _broadcast,
    _copy,
    _digest,
    _holds_dtensor,
    _user,
)

__all__ = ["CheckpointError", "ModelRoundTrip", "model_round_trip", "state_owner"]


@dataclass(frozen=True)
class ModelRoundTrip:
    """The fresh (module, wrapper) with the saved state loaded, and how it was played."""

    model: nn.Module
    wrapped: nn.Module
    kind: str
    note: str


def state_owner(wrapped: nn.Module) -> nn.Module:
    """Whose `state_dict()` a user saves (module docstring)."""
    cls = type(wrapped)
    if cls.state_dict is not nn.Module.state_dict:
        return wrapped
    inner = getattr(wrapped, "module", None)
    return inner if isinstance(inner, nn.Module) else wrapped


def model_round_trip(
    wrapped: nn.Module,
    rebuild: Callable[[], tuple[nn.Module, nn.Module]],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
) -> ModelRoundTrip:
    """Save what `state_owner(wrapped)` returns, `rebuild()` a fresh (module, wrapper), load.

    A collective: call it on every rank at the same point of training (the kind is decided
    from one `all_gather_object` of each rank's digest, the same on every rank).

    Raises:
        CheckpointError: `state_dict()`, the rebuild or `load_state_dict()` raised.
    """
    owner = state_owner(wrapped)
    call = f"{type(owner).__name__}.state_dict()"
    mine = _user("state_dict", call, owner.state_dict)
    digest = "dtensor" if _holds_dtensor(mine, 0) else _digest(mine)
    digests = [digest] * world_size
    if world_size > 1:
        dist.all_gather_object(digests, digest)
    if "dtensor" in digests:
        kind, note = (
            "per-rank",
            "it holds DTensors (a sharded state dict): each rank loaded its own",
        )
    elif len(set(digests)) == 1:
        kind, note = "full", "identical on every rank: rank 0's loaded on every rank"
    else:
        kind, note = "per-rank", "it differs between ranks (shards): each rank loaded its own"
    if kind == "per-rank":
        state = _copy(mine, to_cpu=False)
    else:
        object_device = device if device.type == "cuda" else None
        state = _broadcast(
            _copy(mine, to_cpu=True) if rank == 0 else None, world_size, object_device
        )
    del mine
    model, fresh = _user("rebuild", "building a fresh model and wrapper", rebuild)
    target = state_owner(fresh)
    whose = "rank 0's state" if kind == "full" else "this rank's own state"
    call = f"{type(target).__name__}.load_state_dict() of {whose}"
    _user("load_state_dict", call, target.load_state_dict, state)
    return ModelRoundTrip(model, fresh, kind, f"{type(owner).__name__}.state_dict(): {note}")
