"""When a step's gradients are final: at the step's pre-hook, or when its closure returns.

`optimizer.step()` called after `backward()` (a plain loop, accelerate's
`AcceleratedOptimizer`, Lightning's manual optimization) finds this step's gradients in place
at the step's pre-hook. `optimizer.step(closure)` does not: the forward and the backward run
inside the step, when the optimizer calls the closure, so the pre-hook sees the gradients of
the step before (or none, or, under gradient accumulation, an earlier micro-step's that were
never synchronized). That is how PyTorch Lightning steps under automatic optimization (its
closure runs `training_step`, `zero_grad`, `backward`, then `on_before_optimizer_step` and
gradient clipping, all inside `optimizer.step(closure=...)`), and how `LBFGS` users step.

So an audit point "before the step" is run where the step's gradients are final:

    no closure        at the pre-hook, as ever
    a closure         when the closure first returns, before the optimizer uses what it
                      computed: the parameters have not moved, this step's forward has run
                      (and DDP's broadcast of the buffers with it), and its backward (and
                      DDP's all-reduce of the gradients) is done
    a closure the     at the post-hook, before the "after" point: the gradients are as
    step never calls  final as they will be (a custom optimizer that ignores its closure)

Only the first return counts: `LBFGS` calls its closure again at every point of its line
search, and its first call is the one that gives the gradients at the step's starting point.
The wrapper passes every argument and the closure's return value through unchanged and runs
the audit under `torch.no_grad()` (the optimizer calls the closure under `enable_grad()`; the
audit only reads tensors). The audit must not raise (the caller guards it), so the script's
closure sees no difference but the time the audit takes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verify.patching import WRAPPERS


class Deferred:
    """An audit point waiting for the closure of the step in progress (module docstring)."""

    def __init__(self, audit: Callable[[], None]) -> None:
        self._audit: Callable[[], None] | None = audit

    def run(self) -> None:
        """Run the audit if it has not run yet; later calls do nothing."""
        audit, self._audit = self._audit, None
        if audit is not None:
            with torch.no_grad():
                audit()

    @property
    def pending(self) -> bool:
        return self._audit is not None


def closure_of(args: tuple, kwargs: dict) -> Callable | None:
    """The closure passed to `optimizer.step` (its pre-hook's `args`, the optimizer first, and
    `kwargs`), or None: the step runs no forward and backward of its own."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    return closure if callable(closure) else None


def defer(args: tuple, kwargs: dict, audit: Callable[[], None]) -> tuple | None:
    """If the step takes a closure: `(deferred, (args, kwargs))`, the step's arguments with the
    closure wrapped to run `audit` when it first returns (a pre-hook returns the pair to
    substitute them). None when there is no closure: audit at the pre-hook."""
    closure = closure_of(args, kwargs)
    if closure is None:
        return None
    deferred = Deferred(audit)

    def audited_closure(*a, **kw):
        out = closure(*a, **kw)
        deferred.run()
        return out

    WRAPPERS.add(audited_closure.__code__)  # a pass-through to the script's closure

    if "closure" in kwargs:
        kwargs = {**kwargs, "closure": audited_closure}
    else:
        args = (args[0], audited_closure, *args[2:])
    return deferred, (args, kwargs)
