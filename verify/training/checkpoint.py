"""The optimizer `state_dict()` round trip, for full and for per-rank checkpoints.

Resuming from a checkpoint must not change training: save the optimizer's state, build a
fresh optimizer, load the state, and the next steps must be the ones the run would have taken.
Optimizers checkpoint in three legitimate ways, and the round trip plays each the way its
users would:

- "full": `state_dict()` returns the whole, unsharded state, the same on every rank (plain
  optimizers; ZeRO implementations that gather it, like `impls.zero.ShardedOptimizer`).
  Rank 0's copy is loaded on every rank, as a checkpoint written by rank 0 would be. This is
  also what exposes a `state_dict()` that lists every parameter but holds only the local
  shard's state: the other ranks resume from rank 0's shard.
- "consolidated": PyTorch's ZeroRedundancyOptimizer style: `consolidate_state_dict(to=0)` on
  every rank, then only rank 0 can return the full state; it is broadcast and loaded
  everywhere.
- "per-rank": each rank's dict describes its own shard (what torch.distributed.checkpoint
  does: one shard per rank), and each rank loads its own. Told by what `state_dict()`
  returns, measured against the parameters the tool passed (not against the optimizer's own
  `param_groups`, which a per-rank design may trim to its shard): some rank's dict
  references fewer parameters than were passed (a whole-parameter shard), or the ranks'
  dicts differ and hold state tensors smaller than the parameters they are keyed to (a
  slice of each parameter, as DeepSpeed and FSDP shard).

A dict that lists every parameter at full size but differs between ranks is played as
"full": loaded from rank 0, as a checkpoint written by rank 0 would be. That is a correct
optimizer's `state_dict()` only if it is the same everywhere.

Every failure inside the user's code comes back as a `CheckpointError` naming the call, so a
report can say "after a state_dict load" instead of blaming the next `step()`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("full", "consolidated", "per-rank")


@dataclass(frozen=True)
class RoundTrip:
    """The optimizer to train on after the round trip, and how the checkpoint was played.

    Attributes:
        optimizer: the freshly built optimizer, with the saved state loaded.
        kind: "full", "consolidated" or "per-rank" (see the module docstring).
        note: one line on why this kind was chosen, for reports.
    """

    optimizer: Any
    kind: str
    note: str = ""


class CheckpointError(Exception):
    """A user call in the round trip raised. `phase` is "state_dict" (including
    `consolidate_state_dict`), "rebuild" or "load_state_dict"; the message names the call and
    the original exception, which is also chained as `__cause__`."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(message)
        self.phase = phase


def round_trip(
    optimizer: Any,
    rebuild: Callable[[], Any],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    param_numels: Sequence[int],
    sharded_params: bool = False,
) -> RoundTrip:
    """Save `optimizer`'s state, build a fresh one with `rebuild()`, load the state into it.

    A collective: call it on every rank at the same point of training, or it hangs. The kind
    of checkpoint is decided identically on every rank (one `all_gather_object` of a fixed
    summary per rank: how many parameters its dict references, a digest of its contents, and
    its first state tensor smaller than its parameter, if any).

    Args:
        optimizer: the optimizer to checkpoint (plain, or a sharded one).
        rebuild: returns a fresh optimizer over the same parameters, as at construction (the
            caller rebuilds and restores any LR scheduler itself).
        rank, world_size: this rank in the default process group, and its size.
        device: this rank's device (NCCL's object collectives need it).
        param_numels: the number of elements of each parameter the optimizer was given, in
            the order given (all groups): what the kind is measured against.
        sharded_params: the model's parameters are this rank's shards (a wrapper with
            `full_parameters()`, ZeRO-3): state over them is this rank's own, per-rank.

    Raises:
        CheckpointError: `state_dict()`, `consolidate_state_dict()`, `rebuild()` or
            `load_state_dict()` raised; the message says which and on what.
    """
    object_device = device if device.type == "cuda" else None
    if callable(getattr(optimizer, "consolidate_state_dict", None)):
        kind, note = "consolidated", "consolidate_state_dict(to=0), rank 0's broadcast to all"
        consolidate = optimizer.consolidate_state_dict
        _user("state_dict", "consolidate_state_dict(to=0)", consolidate, to=0)
        state = None
        if rank == 0:  # ZeroRedundancyOptimizer raises on the other ranks
            saved = _user("state_dict", "state_dict() after consolidation", optimizer.state_dict)
            state = _copy(saved, to_cpu=True)
        state = _broadcast(state, world_size, object_device)
        what = "the consolidated state (rank 0's)"
    else:
        mine = _user("state_dict", "state_dict()", optimizer.state_dict)
        kind, note = _kind(mine, world_size, param_numels, sharded_params)
        if kind == "per-rank":
            state, what = _copy(mine, to_cpu=False), "this rank's own state (a per-rank checkpoint)"
        else:
            state = _copy(mine, to_cpu=True) if rank == 0 else None
            state = _broadcast(state, world_size, object_device)
            what = "rank 0's full state"
    fresh = _user("rebuild", "rebuilding the optimizer", rebuild)
    _user("load_state_dict", f"load_state_dict() of {what}", fresh.load_state_dict, state)
    return RoundTrip(fresh, kind, note)


def _kind(
    mine: Any, world_size: int, param_numels: Sequence[int], sharded_params: bool
) -> tuple[str, str]:
    """ "full" or "per-rank", and why, from this rank's `state_dict()` and every other rank's:
    one `all_gather_object` of a summary of each (`round_trip`), `_decide`d the same on every
    rank."""
    # State of parameter shards (ZeRO-3's; a DTensor is one by type, FSDP2's) is per-rank:
    # marked in the digest, so every rank sees it and all take the per-rank path together.
    shards = "shards:" if sharded_params or _holds_dtensor(mine, 0) else ""
    summary = (_params_listed(mine), shards + _digest(mine), _slice_of(mine, param_numels))
    summaries: list = [summary] * world_size
    if world_size > 1:
        dist.all_gather_object(summaries, summary)
    if any(d.startswith("shards:") for _, d, _ in summaries):
        return "per-rank", "the state is of parameter shards: each rank loaded its own"
    return _decide(summaries, len(param_numels))


def _decide(summaries: list[tuple], num_params: int) -> tuple[str, str]:
    """The checkpoint kind from every rank's (parameters listed, digest, slice); the same on
    every rank. `num_params` is how many parameters the tool passed."""
    short = [(r, n) for r, (n, *_) in enumerate(summaries) if n is not None and n < num_params]
    if short:
        r, n = short[0]
        return "per-rank", (
            f"rank {r}'s state_dict() lists {n} of the {num_params} parameters passed: a "
            "per-rank checkpoint, each rank loaded its own"
        )
    identical = len({d for _, d, *_ in summaries}) == 1
    if identical:
        return "full", "every rank's state_dict() is identical: rank 0's loaded on every rank"
    if any(n is None for n, *_ in summaries):
        return "per-rank", (
            "state_dict() is not in torch.optim's format and differs between ranks: "
            "each rank loaded its own"
        )
    sliced = [(r, piece) for r, (_, _, piece) in enumerate(summaries) if piece]
    if sliced:
        r, (index, name, numel, whole) = sliced[0]
        return "per-rank", (
            f"the ranks' state_dict()s differ and rank {r}'s holds slices ({name!r} of "
            f"parameter {index}: {numel} of its {whole} elements): a per-rank checkpoint, "
            "each rank loaded its own"
        )
    return "full", (
        f"every rank's state_dict() lists all {num_params} parameters, at full size, but the "
        "ranks' dicts differ: rank 0's loaded on every rank, as a checkpoint written by rank 0 "
        "would be"
    )


def _slice_of(state: Any, param_numels: Sequence[int]) -> tuple[int, str, int, int] | None:
    """The first state tensor of a torch.optim-format dict smaller than the parameter it is
    keyed to, as (index, name, its elements, the parameter's), or None. Scalars (no
    dimension: `step`) are not slices. Index i is the i-th parameter passed, which holds for a
    dict that lists all of them (a shorter one is per-rank anyway)."""
    try:
        for index, entry in state["state"].items():
            whole = param_numels[index] if 0 <= index < len(param_numels) else None
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and whole is not None:
                    if value.numel() < whole:
                        return index, str(name), value.numel(), whole
    except Exception:  # not torch.optim's format: told apart by _params_listed
        return None
    return None


def _user(phase: str, call: str, fn: Callable, *args, **kwargs):
    """Run a call into the user's optimizer; re-raise anything as a CheckpointError."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(phase, f"{call} raised {type(exc).__name__}: {text}") from exc


def _broadcast(obj: Any, world_size: int, device: torch.device | None) -> Any:
    """Rank 0's `obj` on every rank (each rank gets its own unpickled copy)."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def _holds_dtensor(obj: Any, depth: int) -> bool:
    if hasattr(obj, "device_mesh") and isinstance(obj, torch.Tensor):
        return True
    if depth > 32:
        return False
    if isinstance(obj, dict):
        return any(_holds_dtensor(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_dtensor(v, depth + 1) for v in obj)
    return False


def _params_listed(state: Any) -> int | None:
    """How many parameters a torch.optim-format dict's `param_groups` reference, or None."""
    try:
        return sum(len(g["params"]) for g in state["param_groups"])
    except Exception:
        return None


def _copy(obj: Any, to_cpu: bool) -> Any:
    """A copy that shares no tensor with the optimizer it came from (the checkpoint on disk):
    on the CPU for a state that travels to other ranks, on its own device for a rank's own."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.cpu().clone() if to_cpu else t.clone()
    if isinstance(obj, dict):
        return {k: _copy(v, to_cpu) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v, to_cpu) for v in obj]
    if isinstance(obj, tuple):
        items = [_copy(v, to_cpu) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _digest(state: Any) -> str:
    """A digest of a state dict's contents: tensors by dtype, shape and bytes (not device:
    rank r's state lives on cuda:r), dicts regardless of key order."""
    h = hashlib.sha256()
    _feed(h, state, 0)
    return h.hexdigest()


def _feed(h, obj: Any, depth: int) -> None:
    if depth > 32:
        h.update(b"<deep>")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "to_local"):  # a DTensor (FSDP2's state): this rank's shard is its state
            t = t.to_local()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        try:
            if t.numel():
                h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        except Exception:  # sparse, quantized, ...: compare what can be compared
            h.update(repr(t.layout).encode())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k, v in sorted(obj.items(), key=lambda kv: repr(kv[0])):
            h.update(repr(k).encode())
            _feed(h, v, depth + 1)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v, depth + 1)
        h.update(b"]")
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(repr(obj).encode())
    else:  # an arbitrary object: its repr may hold an address, which differs between ranks
        h.update(type(obj).__qualname__.encode())
