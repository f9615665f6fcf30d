"""`torch.accelerator` as a CUDA node would answer it, on CPU ranks.

PyTorch's device-generic API (`torch.accelerator`, torch 2.6 on) is what current scripts ask
instead of `torch.cuda`: pytorch/examples' distributed scripts take
`device = torch.accelerator.current_accelerator()`, count `device_count()` GPUs (and leave
when there are too few), `set_device_index(local_rank)`, and pass
`get_default_backend_for_device(device)` to `init_process_group`. On a CPU-only torch it
answers no accelerator, none, 0. Under a rehearsal it is mapped as `torch.cuda` is
(`cuda_api.py`), over the same node (`standins.Node`: what `set_device_index` chose is what
`torch.cuda.current_device()` answers):

- questions: `is_available()` True, `current_accelerator()` `device(type='cuda')` (so the
  default backend for it is "nccl", which the process group maps to gloo), `device_count()`
  the node's GPUs, `current_device_index()` the one chosen, `get_device_capability()` an
  8.0 GPU's, the memory figures 0 (`get_memory_info()` the host's memory, free);
- ordering and choosing: `set_device_index`, `with device_index(i):`, `synchronize`,
  `empty_cache`, the peak resets are no-ops; `current_stream()` is the no-op CUDA stream,
  `set_stream` does nothing;
- `torch.accelerator.Graph` is refused, as CUDA graphs are.

Torch asking itself (the process group, a DataLoader's pinning) gets the CPU build's answers
(`standins.torch_asks`). A function of `torch.accelerator` left unmapped is counted where the
script asks it (`standins.count_every_unmapped`).
"""

from __future__ import annotations

import contextlib

import torch

from verify.oncpu import standins
from verify.oncpu.cuda_api import properties
from verify.oncpu.ledger import Ledger
from verify.oncpu.standins import Node
from verify.patching import Patches

PREFIX = "torch.accelerator"
MEMORY = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")
RESETS = ("empty_cache", "empty_host_cache", "reset_peak_memory_stats",
          "reset_accumulated_memory_stats")  # fmt: skip


def install(ledger: Ledger, patches: Patches, node: Node) -> None:
    """Replace `torch.accelerator`'s calls as the module docstring says."""
    acc = getattr(torch, "accelerator", None)
    if acc is None:  # a torch before 2.6: nothing to map
        return
    total = properties().total_memory
    answers = {
        "is_available": True, "current_accelerator": torch.device("cuda"),
        "device_count": node.count, "get_device_capability": {"major": 8, "minor": 0},
        "memory_stats": {}, "get_memory_info": (total, total),
        **dict.fromkeys(MEMORY, 0),
    }  # fmt: skip
    for owner in (acc, getattr(acc, "memory", None)):
        if owner is None:
            continue
        for name, value in answers.items():
            if hasattr(owner, name):
                stand_in = standins.answer(ledger, f"{PREFIX}.{name}", getattr(owner, name), value)
                patches.apply(owner, name, stand_in)
        for name in (*RESETS, "synchronize"):
            if hasattr(owner, name):
                patches.apply(owner, name, standins.no_op(ledger, f"{PREFIX}.{name}"))
    _devices(ledger, patches, node, acc)
    _streams(ledger, patches, acc)
    why = "an accelerator graph replays captured GPU kernels, and a CPU rank has none to capture"
    if hasattr(acc, "Graph"):
        patches.apply(acc, "Graph", standins.refuse(ledger, f"{PREFIX}.Graph", why))


def _devices(ledger: Ledger, patches: Patches, node: Node, acc) -> None:
    """The index the script chooses, kept on the node; choosing does nothing on a CPU."""

    def current_index():
        if standins.torch_asks():
            return 0
        ledger.mapped(f"{PREFIX}.current_device_index()", "the device set", direct=True)
        return node.device

    def set_index(device):
        ledger.mapped(f"{PREFIX}.set_device_index()", "no-op")
        node.choose(device)

    @contextlib.contextmanager
    def device_index(device):
        ledger.mapped(f"{PREFIX}.device_index()", "no-op")
        was = node.device
        if device is not None:
            node.choose(device)
        try:
            yield
        finally:
            node.device = was

    for name, stand_in in (("current_device_index", current_index),
                           ("current_device_idx", current_index),
                           ("set_device_index", set_index), ("set_device_idx", set_index),
                           ("device_index", device_index)):  # fmt: skip
        if hasattr(acc, name):
            patches.apply(acc, name, stand_in)


def _streams(ledger: Ledger, patches: Patches, acc) -> None:
    """The current stream is the rehearsal's no-op CUDA stream (`cuda_api._streams`)."""

    def current_stream(device=None):
        if standins.torch_asks():
            return original(device)
        ledger.mapped(f"{PREFIX}.current_stream()", "a no-op stream", direct=True)
        with ledger.quiet():
            return torch.cuda.Stream()

    original = acc.current_stream
    patches.apply(acc, "current_stream", current_stream)
    patches.apply(acc, "set_stream", standins.no_op(ledger, f"{PREFIX}.set_stream"))
