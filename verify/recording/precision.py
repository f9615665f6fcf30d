"""The precision a run's computation ran in, beyond its tensors' dtypes: autocast.

Under `torch.autocast(dtype=torch.bfloat16)` the parameters, their gradients and the loss
are float32 tensors, yet the matmuls that produced them ran on bfloat16 operands: two runs
that sum in different orders differ by bfloat16's roundings, not float32's. The recording
keeps the autocast dtypes a run entered (`AutocastTap`), and the comparison's tolerance
follows the lowest precision that touched the computation (`tolerance.compute_dtype`).

What is seen: every `torch.autocast` (and `torch.amp.autocast`, `torch.cuda.amp.autocast`,
which enter through it) entered with `enabled=True`, where the script enters it (nanoGPT's
`with ctx:` around the forward, the backward outside it), and autocast found on at a
`backward()` call (`seen_at_backward`). A context entered inside a `torch.compile`d
function is traced, not entered at run time: such a run is seen at its backward only if the
backward runs under autocast too.
"""

from __future__ import annotations

import torch

from verify.patching import Patches


class AutocastTap:
    """The dtypes autocast was entered with, enabled, while installed (`dtypes`)."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()
        self._patches = Patches()

    def install(self) -> None:
        from torch.amp import autocast_mode

        original = autocast_mode.autocast.__enter__
        tap = self

        def __enter__(ctx):
            entered = original(ctx)
            if getattr(ctx, "_enabled", False) and getattr(ctx, "fast_dtype", None) is not None:
                tap.dtypes.add(_name(ctx.fast_dtype))
            return entered

        self._patches.apply(autocast_mode.autocast, "__enter__", __enter__)

    def remove(self) -> None:
        self._patches.restore()

    def seen_at_backward(self, device_type: str) -> None:
        """A backward called under autocast (on `device_type`): its dtype counts too."""
        if torch.is_autocast_enabled(device_type):
            self.dtypes.add(_name(torch.get_autocast_dtype(device_type)))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
