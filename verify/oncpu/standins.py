"""The kinds of stand-in a rehearsal puts in place of a device API's call, shared by
`torch.cuda` (`cuda_api.py`) and `torch.accelerator` (`accelerator_api.py`): an answer as a
GPU node would give it, a no-op, a refusal, and a question left to torch but counted.

Every stand-in counts the call at the user's line (`Ledger`). A question is answered as a
GPU node would only where the script (or a library it calls) asks; torch asking itself gets
the CPU build's answer, so that its own choices stay CPU ones (`torch_asks`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from verify.oncpu.ledger import Ledger
from verify.patching import Patches

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Node:
    """The rehearsed GPU node as the script sees it: how many GPUs it has (`count`) and the
    one the script chose (`device`), shared by `torch.cuda` and `torch.accelerator` so that
    `set_device_index(1)` is what `torch.cuda.current_device()` answers."""

    count: int
    device: int = 0

    def choose(self, device) -> None:
        """The index `device` names (an int, "cuda:1", a torch.device; None or -1: 0)."""
        import torch

        if isinstance(device, torch.device | str):
            device = torch.device(device).index or 0
        self.device = int(device) if device is not None and device >= 0 else 0


def torch_asks() -> bool:
    """Whether torch itself (or this tool) asks, rather than the script or a library it
    calls (module docstring)."""
    from verify.launching.needs_cuda import TORCH_OR_TOOL, path_kind

    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith("<"):
        return False
    return path_kind(frame.f_code.co_filename) == TORCH_OR_TOOL


def answer(ledger: Ledger, label: str, original, value):
    """`value` for the script's question `label` ("torch.cuda.device_count"), `original`'s
    answer for torch's own."""
    shown = repr(value) if len(repr(value)) <= 24 else "a GPU's figures"

    def call(*args, **kwargs):
        if torch_asks():
            return original(*args, **kwargs)
        ledger.mapped(f"{label}()", shown, direct=True)
        return value

    return call


def no_op(ledger: Ledger, label: str):
    """A call that orders or frees GPU work: nothing to do on a CPU."""

    def call(*args, **kwargs):
        ledger.mapped(f"{label}()", "no-op")

    return call


def refuse(ledger: Ledger, label: str, why: str):
    """A call that cannot run without a GPU: refused with its line (`Ledger.refuse`)."""

    def call(*args, **kwargs):
        ledger.refuse(label, why)

    return call


def count_unmapped(ledger: Ledger, patches: Patches, owner, prefix: str) -> None:
    """Every public function of `owner` the rehearsal left as torch's, counted where the
    script calls it (`Ledger.asked`) and answered by torch as a CPU machine would: what a
    script that still leaves before joining asked that was not mapped."""
    import functools
    import inspect

    home = owner.__name__.split(".")[:2]  # torch.cuda's own, not what it imports
    for name in dir(owner):
        original = getattr(owner, name, None)
        if name.startswith("_") or patches.replaced(owner, name):
            continue
        cached = isinstance(original, functools._lru_cache_wrapper)  # `is_available`s often are
        if not (inspect.isfunction(original) or inspect.isbuiltin(original) or cached):
            continue
        if (getattr(original, "__module__", None) or "").split(".")[:2] != home:
            continue
        patches.apply(owner, name, _counted(ledger, f"{prefix}.{name}()", original))


def count_every_unmapped(ledger: Ledger, patches: Patches) -> None:
    """`count_unmapped` over the device APIs a script asks which device it runs on:
    `torch.cuda`, `torch.accelerator` (and its `memory`), and the other accelerators'
    (`torch.xpu`, `torch.mps`, `torch.backends.mps`), which answer as on a CUDA node."""
    import importlib

    for name in ("torch.cuda", "torch.cuda.memory", "torch.accelerator",
                 "torch.accelerator.memory", "torch.xpu", "torch.mps", "torch.backends.mps"):  # fmt: skip
        try:
            owner = importlib.import_module(name)
        except ImportError:  # an older torch
            continue
        count_unmapped(ledger, patches, owner, name)


def _counted(ledger: Ledger, label: str, original):
    def call(*args, **kwargs):
        value = original(*args, **kwargs)
        ledger.asked(label, value)
        return value

    call.__name__ = call.__qualname__ = getattr(original, "__name__", label)
    call.__doc__ = getattr(original, "__doc__", None)
    call.__wrapped__ = original
    if hasattr(original, "cache_clear"):  # an lru_cache's own (torch clears some)
        call.cache_clear = original.cache_clear
    return call
