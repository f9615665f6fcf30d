"""A race sanitizer for async collectives: catch on every run what GPUs show now and then.

What a race is here. An async collective (`async_op=True`, `isend`/`irecv`,
`batch_isend_irecv`) owns the memory it was handed from issue until it completes: until the
user calls `Work.wait()`, or the work's future completes. Meanwhile, memory the collective
only reads (an all-gather's input, a send, a broadcast on its source) must not be written, and
memory it writes (an in-place all-reduce, a broadcast on receivers, an output, a receive) must
be neither read nor written, through any view of the same storage whose bytes overlap. The
classic bugs: dividing a gradient before `wait()`, `optimizer.step()` before the all-reduce
finished, refilling a staging buffer while it is still being sent, an async broadcast of
parameters never waited on. On CPU/gloo they come out right most of the time.

How it works (`Sanitizer`, one per rank):

1. Access checking. The collective functions of `torch.distributed` and `Work.wait` /
   `Work.get_future` are wrapped (on top of whatever is installed, e.g. the collective
   tracer). From a tracked work's issue to its completion a `TorchDispatchMode` sees every
   operator, including those autograd and optimizers run from C++, classifies its arguments
   as read or written from the operator's schema, and reports any overlap with held memory
   (`access.py`). Findings name the operator, the tensor (names from `name_tensors`), the
   collective and both source lines, and are deduplicated with a count (`findings.py`).
   At `end_step()`, every work issued and not waited on (nor its future completed) is a
   "never waited" finding.
2. Adversarial completion (`adversarial=True`). The real collective runs on private clones
   taken at issue, and its results are copied into the user's tensors only at completion
   (`collectives.py`). A race then changes the numbers the same way on every run: a gradient
   divided before `wait()` ends up as the undivided sum, an optimizer that steps before
   `wait()` uses the local gradient, a broadcast never waited on never lands. Blocking
   collectives are untouched.

What it cannot see:

- Collectives issued from C++: PyTorch DDP's reducer (its gradient all-reduces and buffer
  broadcasts), `_broadcast_coalesced`; and functional collectives
  (`torch.distributed._functional_collectives`), which are not wrapped.
- Memory touched outside the dispatcher: C++ code working on raw pointers, numpy arrays that
  share a tensor's memory, custom CUDA kernels and work on other CUDA streams (PyTorch's CUDA
  stream sanitizer covers streams), and operators run on threads other than the one that
  installed the sanitizer (collectives issued from other threads are not tracked at all).
- Operators whose schema does not declare their writes (some custom ops), and races inside
  the first backward pass that issues a collective from a gradient hook when a whole
  optimizer step before it issued none from backward (see "Cost" for why backward is armed
  only then).
- `Work.is_completed()` is not completion: reading a result after polling it, without
  `wait()`, is reported (and under adversarial completion the result is not there yet).

Cost. Outside the windows where a tracked work is in flight nothing runs, except a backward
pass, which is checked from its start (armed) until an optimizer step has ended after a
backward (every micro-batch of the first step: one under `no_sync()` issues nothing, the
step's last one does), and afterwards when any backward so far issued an async collective:
autograd runs each node with the thread-local state captured when backward began, so a check
switched on inside a gradient hook would not outlive that hook. While the check is on, every operator makes a detour through Python (the
dispatcher's cost, several microseconds) plus a dictionary lookup per tensor argument; each
async collective costs a frame walk, one clone of its tensors at issue and one copy back at
completion (adversarial), i.e. twice its bytes of memory traffic and its bytes in memory
while in flight. `Sanitizer.stats` says where the time went.
"""

from __future__ import annotations

from torch import nn

from verify.sanitize.findings import (
    NEVER_WAITED,
    READ_WHILE_IN_FLIGHT,
    WRITE_WHILE_IN_FLIGHT,
    CollectiveRef,
    RaceFinding,
    SanitizerStats,
)
from verify.sanitize.sanitizer import Sanitizer

__all__ = [
    "NEVER_WAITED",
    "READ_WHILE_IN_FLIGHT",
    "WRITE_WHILE_IN_FLIGHT",
    "CollectiveRef",
    "RaceFinding",
    "Sanitizer",
    "SanitizerStats",
    "blind_spots",
]


def blind_spots(wrapped_model: nn.Module) -> list[str]:
    """Sentences naming what the sanitizer cannot check in this model (empty: none known)."""
    from torch.nn.parallel import DistributedDataParallel

    spots = []
    if any(isinstance(m, DistributedDataParallel) for m in wrapped_model.modules()):
        spots.append(
            "PyTorch DDP's reducer issues its collectives from C++: the sanitizer cannot see "
            "them, so races on its gradient buckets go unchecked"
        )
    if type(wrapped_model).__name__ == "OptimizedModule":  # torch.compile's wrapper
        spots.append(
            "the model is compiled: fused kernels are seen as single operators and collectives "
            "traced into the graph are not wrapped"
        )
    return spots
