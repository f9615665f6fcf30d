"""The yardstick of the optimizer-state measures: each parameter's state under a plain
(unsharded) optimizer, stepped once on copies (`optim_state.py` measures what a rank holds).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlainState:
    """One parameter's state under a plain (unsharded) optimizer.

    Attributes:
        bytes: every state tensor's bytes.
        scalar_bytes: the part of `bytes` in tensors of at most one element (`step`).
        numel: the parameter's number of elements.
    """

    bytes: int
    scalar_bytes: int
    numel: int

    @property
    def vector_bytes(self) -> int:
        """The state that grows with the parameter (AdamW's moments)."""
        return self.bytes - self.scalar_bytes

    @property
    def element_bytes(self) -> int:
        """Vector state bytes per element of the parameter (8 for AdamW in float32), rounded
        up: what one element of padding costs a shard."""
        return -(-self.vector_bytes // self.numel) if self.numel else 0


def unsharded_state(
    params: Iterable[torch.Tensor],
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    **defaults,
) -> list[PlainState]:
    """Each parameter's state under a plain `optimizer_cls` stepped once on copies.

    The copies get zero gradients (state size does not depend on the values) and live on the
    parameters' devices, so the sizes match what a rank would hold. An empty `params` gives
    `[]` (a plain optimizer refuses an empty list; a rank that owns nothing is no error).
    """
    params = list(params)
    if not params:
        return []
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.zeros_like(c)
    probe = optimizer_cls(copies, **defaults)
    probe.step()
    out = []
    for c in copies:
        sizes = [
            (t.numel() * t.element_size(), t.numel() <= 1)
            for t in plain_tensors(probe.state.get(c, {}))
        ]
        out.append(PlainState(sum(n for n, _ in sizes), sum(n for n, s in sizes if s), c.numel()))
    return out


def plain_tensors(obj: object) -> Iterable[torch.Tensor]:
    """The tensors in one parameter's state of a plain optimizer (dicts and lists)."""
    if issubclass(type(obj), torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from plain_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from plain_tensors(v)
