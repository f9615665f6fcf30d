"""When the class under test cannot be driven as the contract says: a usage error, not a fault.

The contract (docs/verify-your-own-ddp.md): a DDP wrapper is constructed as `Cls(module)`
(plus `bucket_size_mb=` or `bucket_cap_mb=` when it takes one), its forward runs the wrapped
module with `(*inputs, **kwargs)`, `finish_gradient_synchronization()` and
`on_train_batch_start()` take no arguments; a sharded optimizer is
`Cls(params, optimizer_cls, **defaults)`. When the tool cannot construct the class that way
(its constructor raises: it wants other arguments, or a framework's global set-up the tool
knows nothing of) or cannot call it (a `TypeError` raised by the call itself, not inside it),
the check cannot run: `InterfaceError`, exit 2 with one
line naming the interface expected. An exception raised by a collective (a mismatch, a peer
that died) is never one: that is a fault of the class, reported as such.
"""

from __future__ import annotations

import re
import traceback

from verify.watching import stacks


class InterfaceError(Exception):
    """The class under test cannot be constructed or driven as the contract says
    (docs/verify-your-own-ddp.md): the check cannot run, a usage error (exit 2), not a fault of
    the class. `reason` is the short form (what raised, where), without the reminder of the
    contract; `exception` the type of what the class raised, and `call` what the tool was
    constructing, when a raise of the class is the cause (typed: a hint reads them)."""

    def __init__(self, message: str, reason: str = "", *, exception: str = "", call: str = ""):
        super().__init__(message)
        self.reason = reason or message
        self.exception, self.call = exception, call


def distributed(exc: BaseException) -> bool:
    """Raised by a collective (a mismatch, a peer that died): a fault, not an interface. The
    backends raise DistError, or a RuntimeError whose text names them (gloo's
    "Connection closed by peer", NCCL's errors), or, on NCCL, says a tensor is on the wrong
    device (a CPU tensor handed to a collective: c10d's "No backend type associated with
    device type cpu", ATen's "Expected all tensors to be on the same device")."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in _BACKEND_WORDS)


_BACKEND_WORDS = ("gloo", "NCCL", "nccl", "Connection", "connection", "Timed out", "timed out")
# On NCCL, a CPU tensor handed to a collective (c10d's check, and ATen's for mixed devices):
_BACKEND_WORDS += ("No backend type associated with device type", "Expected all tensors to be on")


_SIGNATURE = re.compile(
    r"(got an unexpected keyword argument|takes \d+ positional argument|takes from \d+ to \d+ "
    r"positional|missing \d+ required (positional|keyword-only) argument|got multiple values "
    r"for argument)"
)


def call_mismatch(exc: BaseException) -> bool:
    """A TypeError raised by the call itself (its arguments do not fit the signature), not by
    code inside it: the innermost frame is the caller's, never the class under test's."""
    if not isinstance(exc, TypeError) or not _SIGNATURE.search(str(exc)):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and stacks.is_plumbing(frames[-1].filename)


def constructor_message(spec: str | None, what: str, exc: BaseException) -> tuple[str, str]:
    where = stacks.traceback_site("".join(traceback.format_exception(exc))) or ""
    first = str(exc).splitlines()[0] if str(exc) else ""
    reason = f"constructing {what} raised {type(exc).__name__}: {first}" + (
        f" at {where}" if where else ""
    )
    return (
        f"--impl {spec}: {reason}; the tool constructs a DDP wrapper as Cls(module) (plus "
        "bucket_size_mb= or bucket_cap_mb= when it takes one) and a sharded optimizer as "
        "Cls(params, optimizer_cls, **defaults) (docs/verify-your-own-ddp.md)",
        reason,
    )


def call_message(spec: str | None, what: str, exc: BaseException) -> str:
    return (
        f"--impl {spec}: the tool could not call {what}: {type(exc).__name__}: {exc}; the "
        "contract: forward(*inputs, **kwargs) runs the wrapped module, and "
        "finish_gradient_synchronization() and on_train_batch_start() take no arguments "
        "(docs/verify-your-own-ddp.md)"
    )
