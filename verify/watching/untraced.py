"""Progress the collective trace cannot see: returns from the calls into torch that issue
collectives from C++.

PyTorch DDP's reducer all-reduces gradients from C++ during backward, and its constructor and
forward broadcast from C++: none of it passes through the functions the tracer wraps, so a
DDP job's trace stays empty while it trains. Without a sign of progress, the watchdog could
time a stall only from the ranks' CPU, and a job that trains slowly at little CPU (each rank
waiting a second on its input, then a step of a few milliseconds) would look as still as a
hung one. So, in a traced rank, each return from one of these calls counts as an event in
the trace header (`Writer.progress`): a backward that returned has finished its DDP
all-reduces, and the watchdog reads that as progress, as it does a completed collective. No
record is written: the diagnosis compares only the collectives the trace saw.

The calls, wrapped at `install` (once per process, before the user's code runs):

- `_engine_run_backward` in `torch.autograd` and `torch.autograd.graph`, which
  `Tensor.backward`, `torch.autograd.backward` and `torch.autograd.grad` call (torch 2.x);
- `DistributedDataParallel.__init__` and `.forward`.

Cost: one header written per call that returns, next to a backward pass.
"""

from __future__ import annotations

import functools

import torch

from verify.patching import Patches
from verify.watching.trace_file import Writer

_writer: Writer | None = None
_patches = Patches()


def install(writer: Writer) -> None:
    """Count the returns of the calls above into `writer` (idempotent)."""
    global _writer
    _writer = writer
    if _patches:
        return
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is not None:
        wrapper = _counted(run)
        _patches.apply(torch.autograd.graph, "_engine_run_backward", wrapper)
        if getattr(torch.autograd, "_engine_run_backward", None) is run:
            _patches.apply(torch.autograd, "_engine_run_backward", wrapper)
    ddp = torch.nn.parallel.DistributedDataParallel
    for name in ("__init__", "forward"):
        _patches.apply(ddp, name, _counted(ddp.__dict__[name]))


def uninstall() -> None:
    """Put back what `install` found, where our wrapper is still the one there."""
    global _writer
    _writer = None
    _patches.restore()


def _counted(original):
    @functools.wraps(original)
    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        writer = _writer
        if writer is not None:
            writer.progress()
        return out

    return counted
