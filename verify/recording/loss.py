"""The loss, where the script's backward shows it: the scalar tensor `backward()` is called on.

A script never tells the tool which number is its loss, but every training step ends its
forward in `loss.backward()` (or `torch.autograd.backward(loss)`, `accelerator.backward(loss)`
and Lightning's closure, which call it). `LossTap.install()` wraps `torch.autograd.backward`
(which `Tensor.backward` calls), and adds up, in float64 and without a host sync, the value of
each scalar tensor it is called on, and counts the calls: the micro-steps of the step.

What is recorded for a step is the sum over its micro-steps of what backward was called on,
averaged over the ranks: with gradients averaged across ranks (DDP) and accumulated over
micro-steps, that is the loss whose gradient the step applies, so 1 rank x 4 micro-steps of
`loss / 4` and 2 ranks x 2 micro-steps of `loss / 2` record the same number. A loss scaled by
a GradScaler is recorded scaled (what backward saw). A backward on a non-scalar, or with an
explicit `grad_tensors`, counts as a micro-step and adds nothing. `on_backward`, if given, is
called with the device type of each scalar seen (the recorder asks whether autocast is on
there: `precision.py`).
"""

from __future__ import annotations

import torch

from verify.patching import Patches


class LossTap:
    """Sums what backward is called on (module docstring), until `take()`."""

    def __init__(self, on_backward=None) -> None:
        self.on_backward = on_backward
        self._sum: torch.Tensor | None = None
        self.calls = 0
        self._patches = Patches()

    def install(self) -> None:
        original = torch.autograd.backward
        tap = self

        def backward(tensors, grad_tensors=None, *args, **kwargs):
            tap.saw(tensors, grad_tensors)
            return original(tensors, grad_tensors, *args, **kwargs)

        self._patches.apply(torch.autograd, "backward", backward)

    def remove(self) -> None:
        self._patches.restore()

    def saw(self, tensors, grad_tensors) -> None:
        self.calls += 1
        t = tensors if isinstance(tensors, torch.Tensor) else None
        if t is None and isinstance(tensors, (tuple, list)) and len(tensors) == 1:
            t = tensors[0]
        if t is None or grad_tensors is not None or t.numel() != 1:
            return
        if self.on_backward is not None:
            self.on_backward(t.device.type)
        value = t.detach().reshape(()).to(torch.float64)  # stays on its device: no sync
        self._sum = value if self._sum is None else self._sum + value.to(self._sum.device)

    def take(self) -> tuple[float, int]:
        """(sum of the scalars seen, backward calls) since the last take; NaN when no scalar
        was seen."""
        total = float("nan") if self._sum is None else float(self._sum.cpu())
        calls, self._sum, self.calls = self.calls, None, 0
        return total, calls
